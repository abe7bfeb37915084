"""Self-distillation of a draft model: EAGLE, EAGLE-3 or DFlash for a Llama target,
EAGLE-3 (MLA or MHA layer) for a DeepSeek-V3 target.

1. data: training-corpus prompts in the chat template, continued greedily by the target
   (``data.prepare_sequences``; cached in ``OUT/data``), or one or more files or shard
   directories saved earlier (``data.load_sequence_files``).
2. once: the target's features of every training sequence (``features.TargetFeatures``),
   in fp16 in RAM and in ``OUT/data`` for reruns and ``--resume`` (``feature_cache``);
   without the cache they are computed again for every batch of every epoch.
3. per batch: the draft's own ``extend`` and ``propose`` on the dense training backend
   (``objectives``).
4. per epoch: held-out acceptance through the serving path (``evaluate``), at uniform
   anchors and as greedy decoding would see it, and a resumable checkpoint in
   ``OUT/checkpoint`` (fp32 draft, optimizer tensors in safetensors).
5. the end: the draft in fp16 in ``OUT`` (loadable by ``load_drafter``) and ``manifest.json``.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from engine.config import read_hf_config
from engine.models.llama3 import Llama3Model
from engine.registry import load_model
from engine.spec.drafters import load_drafter, new_drafter, save_drafter
from training.attention import TrainAttentionBackend
from training.checkpoint import load_checkpoint, save_checkpoint
from training.data import SequenceSet, length_batches, pad, prepare_sequences
from training.evaluate import Acceptance, decoding_acceptance, heldout_acceptance
from training.feature_cache import load_or_compute
from training.features import SoftLabels, TargetFeatures
from training.objectives import Batch, describe
from training.recipes import RECIPES, DraftOptions, draft_hf_config

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class TrainConfig:
    target: str  # the target's HF directory
    kind: str  # "eagle" | "eagle3" | "dflash"
    out: str  # the draft's directory (also holds data/ and checkpoint/)
    num_prompts: int = 2000
    max_new_tokens: int = 128
    max_prompt_len: int = 192
    epochs: int = 1
    batch_size: int = 8  # sequences per optimizer step
    lr: float = 1e-3
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    intermediate_size: int = 1536
    num_layers: int | None = None  # None: the kind's default (EAGLE kinds 1, DFlash 2)
    block_size: int = 8  # DFlash
    num_draft_steps: int | None = None  # chain steps trained; None: the kind's default
    draft_vocab_size: int = 16384  # EAGLE-3
    draft_attention: str | None = None  # EAGLE-3: "mha" | "mla"; None: the target's own
    anchors_per_seq: int | None = None  # None: the kind's default; 0: all
    soft_labels: int = 0  # > 0: distil the target's top-k next tokens, not its greedy one
    max_sequences: int | None = None  # train and evaluate on the first N only (quick runs)
    feature_cache: bool = True  # the target's features once, in fp16, not per batch
    val_fraction: float = 0.05
    eval_k: int = 5
    eval_anchors_per_seq: int = 8
    resume: bool = False
    init_from: str | None = None  # a draft directory to start from instead of a fresh draft
    threads: int | None = None
    device: str = "cpu"  # where the target and the draft run ("cuda" on a GPU machine)
    # Training stops once this long has passed (then held-out acceptance and the save, on
    # top), epochs or not; the learning rate decays over this time rather than the steps.
    time_budget_s: float | None = None
    seed: int = 0
    command: str = ""  # the command line, recorded in the manifest

    def __post_init__(self) -> None:
        if self.kind not in RECIPES:
            raise ValueError(f"kind: {self.kind!r} is not a drafter; allowed: {sorted(RECIPES)}")
        for name in (
            "num_prompts",
            "epochs",
            "batch_size",
            "intermediate_size",
            "draft_vocab_size",
            "eval_k",
            "eval_anchors_per_seq",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction: must be in [0, 1), got {self.val_fraction}")
        if self.draft_attention not in (None, "mha", "mla"):
            raise ValueError(f"draft_attention: {self.draft_attention!r}; allowed: ['mha', 'mla']")
        if self.draft_attention is not None and self.kind != "eagle3":
            raise ValueError(f"draft_attention: eagle3 drafts only, not {self.kind}")
        if self.soft_labels < 0:
            raise ValueError(f"soft_labels: must be >= 0, got {self.soft_labels}")
        if self.anchors_per_seq is not None and self.anchors_per_seq < 0:
            raise ValueError(f"anchors_per_seq: must be >= 0, got {self.anchors_per_seq}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens: must be >= 2, got {self.max_new_tokens}")
        if self.max_prompt_len < 8:
            raise ValueError(f"max_prompt_len: must be >= 8, got {self.max_prompt_len}")
        if self.block_size < 2:
            raise ValueError(f"block_size: must be >= 2, got {self.block_size}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers: must be >= 1, got {self.num_layers}")
        most = RECIPES[self.kind].max_num_layers
        if self.num_layers is not None and most is not None and self.num_layers > most:
            layers = "one layer" if most == 1 else f"at most {most} layers"
            raise ValueError(f"num_layers: an {self.kind} draft has {layers}")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device: {self.device!r} is not a torch device ({e})") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {self.device!r}, but this machine has no CUDA device")
        if self.num_draft_steps is not None and self.num_draft_steps < 1:
            raise ValueError(f"num_draft_steps: must be >= 1, got {self.num_draft_steps}")
        if self.resume and self.init_from:
            raise ValueError("init_from: --resume continues OUT/checkpoint; give one, not both")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s: must be > 0, got {self.time_budget_s}")
        if self.max_sequences is not None and self.max_sequences < 1:
            raise ValueError(f"max_sequences: must be >= 1, got {self.max_sequences}")

    def options(self) -> DraftOptions:
        recipe = RECIPES[self.kind]
        return DraftOptions(
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers or recipe.default_num_layers,
            block_size=self.block_size,
            num_drafts=self.num_draft_steps or recipe.default_num_drafts,
            draft_vocab_size=self.draft_vocab_size,
            max_anchors=(
                recipe.default_max_anchors if self.anchors_per_seq is None else self.anchors_per_seq
            ),
            attention=self.draft_attention,
        )


def lr_at(step: int, total: int, config: TrainConfig, elapsed_s: float = 0.0) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak: over the steps, or over
    ``config.time_budget_s`` where it is set (``elapsed_s`` of it gone)."""
    budget = config.time_budget_s
    if budget is not None:  # warmup and decay both in time: the steps are not known
        warmup_s = budget * config.warmup_fraction
        if elapsed_s < warmup_s:
            return config.lr * max(elapsed_s, 1e-3 * warmup_s) / warmup_s
        progress = min(1.0, (elapsed_s - warmup_s) / max(budget - warmup_s, 1e-9))
        return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    warmup = max(1, round(total * config.warmup_fraction))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_draft(
    config: TrainConfig,
    data: SequenceSet | None = None,
    data_meta: dict[str, Any] | None = None,
    log: Log = _stderr,
    evaluate_on: Mapping[str, SequenceSet] | None = None,
) -> dict[str, Any]:
    """Trains a draft for ``config.target`` into ``config.out``; returns the manifest.

    ``data``: pre-built sequences (prompt + the target's greedy continuation) and what the
    manifest should say about them; default: generated from the training corpus (or reused
    from ``OUT/data``). ``evaluate_on``: named sets the trained draft is also decoded on
    (e.g. the committed held-out prompts' continuations), their tau in the manifest's
    ``decoding_tau_on``.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    data_meta = data_meta or {"sources": "given in memory"}
    if data is None:
        data, data_meta = prepare_sequences(
            Path(config.target),
            Path(config.out) / "data" / "sequences.safetensors",
            num_prompts=config.num_prompts,
            max_new_tokens=config.max_new_tokens,
            max_prompt_len=config.max_prompt_len,
            seed=config.seed,
            num_threads=config.threads,
            log=log,
        )
    if config.max_sequences is not None and len(data) > config.max_sequences:
        data = data.subset(range(config.max_sequences))
    train, val = data.split(config.val_fraction, config.seed)
    log(
        f"data: {len(train)} training and {len(val)} held-out sequences, "
        f"{train.num_tokens} tokens ({train.num_continuation_tokens} generated)"
    )
    trainer = DraftTrainer(config, train, log)
    if config.init_from and trainer.first_epoch == 0:
        acceptance, _ = trainer.evaluate(val)
        trainer.initial = acceptance
        log(
            f"before fine-tuning: held-out tau(K={config.eval_k}) {acceptance.tau:.3f} "
            f"(decoding: {acceptance.decoding_tau:.3f})"
        )
    trainer.started = time.monotonic()
    # Within a time budget, held-out acceptance once, at the end, and no checkpoints: the
    # budget is for training.
    boxed = config.time_budget_s is not None
    for epoch in range(trainer.first_epoch, config.epochs):
        if trainer.is_out_of_time():
            break
        record = trainer.run_epoch(epoch)
        trainer.history.append(record)
        last = epoch + 1 == config.epochs or trainer.is_out_of_time()
        if boxed and not last:
            log(f"epoch {epoch + 1}: loss {record['loss']:.4f}, {record['steps']} steps")
            continue
        acceptance, seconds = trainer.evaluate(val)
        record.update(heldout=asdict(acceptance), eval_s=round(seconds, 1))
        log(
            f"epoch {epoch + 1}: loss {record['loss']:.4f}, held-out tau(K={config.eval_k}) "
            f"{acceptance.tau:.3f} (decoding: {acceptance.decoding_tau:.3f}, full K: "
            f"{acceptance.tau_full:.3f}, "
            f"{acceptance.num_anchors} anchors), {record['train_tokens_per_s']:.0f} tok/s "
            f"(features {record['features_s']:.0f} s, draft {record['draft_s']:.0f} s)"
        )
        if not boxed:
            trainer.save_checkpoint(epoch + 1)
    taus = {name: trainer.decoding_tau(sets) for name, sets in (evaluate_on or {}).items()}
    if taus:
        log(f"decoding tau(K={config.eval_k}) on {taus}")
    return finish(config, trainer, data, train, val, data_meta, log, taus or None)


class DraftTrainer:
    """The target (frozen, fp32), its features of the training sequences (cached, or per
    batch), the draft (fp32, AdamW) and one epoch at a time."""

    def __init__(self, config: TrainConfig, train: SequenceSet, log: Log) -> None:
        self.config, self.train, self.device = config, train, torch.device(config.device)
        model, _ = load_model(config.target, dtype="float32", device=self.device)
        self.target = cast(Llama3Model, model).requires_grad_(False)
        recipe, opts = RECIPES[config.kind], config.options()
        self.ckpt_dir = Path(config.out) / "checkpoint"
        state = load_checkpoint(self.ckpt_dir) if config.resume else None
        if state is not None:
            if state.meta["kind"] != config.kind:
                raise ValueError(
                    f"kind: {self.ckpt_dir} holds a {state.meta['kind']} draft, not {config.kind}"
                )
            self.hf = read_hf_config(self.ckpt_dir)
            self.drafter = load_drafter(self.ckpt_dir, self.target, self.device)
            log(f"resuming after epoch {state.meta['epoch']} from {self.ckpt_dir}")
        elif config.init_from:
            # Fine-tuning: the draft's shape and weights come from there, fitted to the new
            # data where its kind needs that (EAGLE-3: the draft vocabulary).
            self.hf = read_hf_config(config.init_from)
            self.drafter = load_drafter(config.init_from, self.target, self.device)
            if self.drafter.kind != config.kind:
                raise ValueError(
                    f"init_from: {config.init_from} holds a {self.drafter.kind} draft, "
                    f"not {config.kind}"
                )
            if recipe.refit is not None:
                self.drafter, self.hf = recipe.refit(
                    self.drafter, self.hf, self.target, train, opts
                )
            log(f"starting from the draft in {config.init_from}")
        else:
            self.hf = draft_hf_config(recipe, read_hf_config(config.target), opts, train)
            self.drafter = new_drafter(config.kind, self.hf, self.target, self.device, config.seed)
            recipe.init_from_target(self.drafter, self.target, train)
        self.module = cast(torch.nn.Module, self.drafter).train()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
        )
        self.history: list[dict[str, Any]] = []
        self.initial: Acceptance | None = None  # --init-from: held-out tau before training
        self.first_epoch = 0
        if state is not None:
            self.optimizer.load_state_dict(state.optimizer_state(self.optimizer))
            self.history, self.first_epoch = state.meta["history"], state.meta["epoch"]
        self.objective = recipe.objective(self.drafter, opts.num_drafts, opts.max_anchors)
        self.features = TargetFeatures(self.target, self.drafter, self.device, config.soft_labels)
        # Features of a batch of training sequences (by index), [B, L, F] fp32, and with
        # --soft-labels the target's top-k next tokens.
        self.batch_features: Callable[[Sequence[int]], tuple[torch.Tensor, SoftLabels | None]]
        self.cache_info: dict[str, Any] | None = None  # for the manifest
        if config.feature_cache:
            cache, self.cache_info = load_or_compute(
                Path(config.out) / "data",
                config.kind,
                Path(config.target),
                self.features,
                train,
                config.batch_size,
                log,
            )
            self.batch_features = cache.padded
        else:
            self.batch_features = lambda indices: self.features.padded(
                [train.sequences[j] for j in indices]
            )
        self.backend = TrainAttentionBackend()
        # One dummy cache per draft layer: the training backend keys its K/V by them.
        num_layers = self.drafter.config.num_hidden_layers
        self.kv = [(torch.empty(0), torch.empty(0)) for _ in range(num_layers)]
        self.lengths = [len(s) for s in train.sequences]
        self.num_batches = len(length_batches(self.lengths, config.batch_size, random.Random(0)))
        self._val_features: list[torch.Tensor] | None = None
        self.started = time.monotonic()  # of training: the time budget's start

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def is_out_of_time(self) -> bool:
        budget = self.config.time_budget_s
        return budget is not None and self.elapsed_s() >= budget

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        config, train = self.config, self.train
        batches = length_batches(
            self.lengths, config.batch_size, random.Random(config.seed + epoch)
        )
        total_steps = self.num_batches * config.epochs
        features_s, draft_s, num_tokens, losses = 0.0, 0.0, 0, []
        last: dict[str, Any] = {}
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{config.epochs}", unit="batch")
        for i, indices in enumerate(bar):
            if self.is_out_of_time():  # cut mid-epoch: evaluated and saved as it is
                break
            step = epoch * self.num_batches + i
            seqs = [train.sequences[j] for j in indices]
            start = time.perf_counter()
            feats, soft = self.batch_features(indices)  # [B, L, F]
            feats = feats.to(self.device)
            if soft is not None:
                soft = SoftLabels(soft.probs.to(self.device), soft.token_ids.to(self.device))
            mid = time.perf_counter()
            batch = Batch(
                tokens=pad(seqs, self.device),
                lengths=torch.tensor([len(s) for s in seqs], device=self.device),
                prompt_lens=torch.tensor(
                    [train.prompt_lens[j] for j in indices], device=self.device
                ),
                soft=soft,
            )
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
            result = self.objective(batch, feats, self.backend, self.kv, generator)
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, config, self.elapsed_s())
            self.optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm)
            self.optimizer.step()
            features_s += mid - start
            draft_s += time.perf_counter() - mid
            num_tokens += sum(len(s) for s in seqs)
            losses.append(result.loss.item())
            last = describe(result)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc0=f"{result.step_accuracy[0]:.2f}")
        bar.close()
        return {
            "epoch": epoch + 1,
            "steps": len(losses),
            "loss": sum(losses) / max(1, len(losses)),
            "last_batch": last,
            "train_tokens_per_s": num_tokens / max(features_s + draft_s, 1e-9),
            "features_s": round(features_s, 1),
            "draft_s": round(draft_s, 1),
        }

    def evaluate(self, val: SequenceSet) -> tuple[Acceptance, float]:
        """Held-out acceptance at uniform anchors and decoded (the target's features of
        ``val`` are computed once)."""
        start = time.perf_counter()
        if self._val_features is None:
            self._val_features = self._features_of(val)
        self.module.eval()
        try:
            acceptance = heldout_acceptance(
                self.drafter,
                val,
                self._val_features,
                self.config.eval_k,
                self.config.eval_anchors_per_seq,
                self.config.seed,
            )
            decoded = decoding_acceptance(self.drafter, val, self._val_features, self.config.eval_k)
            acceptance.decoding_tau = decoded.mean_accepted_length
            acceptance.decoding_steps = decoded.num_drafts
        finally:
            self.module.train()
        return acceptance, time.perf_counter() - start

    def _features_of(self, data: SequenceSet) -> list[torch.Tensor]:
        """The target's features of every sequence of ``data``, a batch at a time."""
        size = self.config.batch_size
        chunks = [data.sequences[i : i + size] for i in range(0, len(data), size)]
        return [f for c in chunks for f in self.features.ragged(c)]

    def decoding_tau(self, data: SequenceSet) -> float:
        """tau of greedy speculative decoding over ``data``'s continuations (K=eval_k)."""
        features = self._features_of(data)
        self.module.eval()
        try:
            stats = decoding_acceptance(self.drafter, data, features, self.config.eval_k)
        finally:
            self.module.train()
        return round(stats.mean_accepted_length, 4)

    def save_checkpoint(self, epochs_done: int) -> None:
        meta = {"kind": self.config.kind, "epoch": epochs_done, "history": self.history}
        save_checkpoint(self.ckpt_dir, self.drafter, self.hf, self.optimizer, meta)


def finish(
    config: TrainConfig,
    trainer: DraftTrainer,
    data: SequenceSet,
    train: SequenceSet,
    val: SequenceSet,
    data_meta: dict[str, Any],
    log: Log,
    decoding_tau_on: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Saves the draft in fp16, checks that it loads, and writes ``manifest.json`` (with
    ``decoding_tau_on``, the draft's tau on named sets, where given)."""
    out, hf, history = Path(config.out), trainer.hf, trainer.history
    save_drafter(trainer.drafter, out, {**hf, "dtype": "float16"}, dtype=torch.float16)
    load_drafter(out, trainer.target, torch.device("cpu"))  # raises if the layout does not load
    last = history[-1] if history else {}
    manifest = {
        "command": config.command,
        "kind": config.kind,
        "target": str(config.target),
        "config": asdict(config),
        "draft_config": {k: v for k, v in hf.items() if k != "architectures"},
        "data": {
            **data_meta,
            "num_sequences": len(data),
            "num_train_sequences": len(train),
            "num_heldout_sequences": len(val),
            "num_train_tokens": train.num_tokens,
            "num_train_generated_tokens": train.num_continuation_tokens,
        },
        "feature_cache": trainer.cache_info,
        "init_from": _init_summary(config.init_from, trainer.initial),
        "epochs": len(history),
        "final_loss": last.get("loss"),
        "heldout_tau": last.get("heldout", {}).get("tau"),
        "heldout_decoding_tau": last.get("heldout", {}).get("decoding_tau"),
        "history": history,
    }
    if decoding_tau_on is not None:
        manifest["decoding_tau_on"] = decoding_tau_on
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"draft saved to {out} (fp16), manifest.json written")
    return manifest


def _init_summary(init_from: str | None, before: Acceptance | None) -> dict[str, Any] | None:
    """What a fine-tuned draft started from: that draft's own recipe, and its tau on this
    run's held-out sequences before fine-tuning (after the recipe's refit, if any: an
    EAGLE-3 draft's new vocabulary rows are the target's until trained)."""
    if not init_from:
        return None
    summary: dict[str, Any] = {
        "path": init_from,
        "heldout_tau_before": before and before.tau,
        "heldout_decoding_tau_before": before and before.decoding_tau,
    }
    path = Path(init_from) / "manifest.json"
    if path.is_file():
        prior = json.loads(path.read_text())
        summary.update(
            command=prior.get("command"),
            num_train_sequences=prior.get("data", {}).get("num_train_sequences"),
            heldout_tau=prior.get("heldout_tau"),
            init_from=prior.get("init_from"),
        )
    return summary
