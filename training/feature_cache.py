"""The frozen target's features of the training sequences, computed once per run in fp16.

The target's forward costs about as much as the draft's own training step, and its
output never changes between epochs, so one pass before training computes it for every
training sequence, keeps it in RAM and saves it as ``OUT/data/features-<kind>-<key>.safetensors``
for ``--resume`` and reruns. ``key`` is a hash of everything the features depend on: the
target's weights (path, size and mtime of each safetensors file), the drafter kind's
layout (which hidden states), the number of soft labels kept per token and the training
sequences themselves. Soft labels (the target's top-k next tokens) come from the same
forward and are stored beside the features: k fp16 probabilities and int32 ids a token.

A matching file is read whole into RAM rather than memory-mapped: [num_tokens, F] fp16 is
2 GB for 600k tokens of EAGLE-3 features on SmolLM2 (F = 1728), and every epoch reads all
of it, so an in-RAM slice per sequence beats paging it in from disk again each epoch.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.models.llama3 import ReturnHiddenStates
from training.data import SequenceSet
from training.features import SoftLabels, TargetFeatures, pad_rows

Log = Callable[[str], None]

FORMAT = 1  # bump when the way features are computed changes: older files then miss


class CachedFeatures:
    """Per training sequence, the target's features (one [num_tokens, F] fp16 tensor) and,
    when kept, its top-k next tokens ([num_tokens, k] fp16 probabilities, int32 ids)."""

    def __init__(
        self,
        store: dict[str, torch.Tensor],  # "features", and "top_probs" with "top_ids"
        lengths: Sequence[int],
    ) -> None:
        self.store = store
        self.offsets = [0, *itertools.accumulate(lengths)]

    def _rows(self, name: str, indices: Sequence[int]) -> torch.Tensor:
        data = self.store[name]
        return pad_rows([data[self.offsets[i] : self.offsets[i + 1]] for i in indices])

    def padded(self, indices: Sequence[int]) -> tuple[torch.Tensor, SoftLabels | None]:
        """[B, L, F] fp32 for the sequences at ``indices``, zero past each one's end; and
        their soft labels when the cache keeps them."""
        soft = None
        if "top_probs" in self.store:
            soft = SoftLabels(self._rows("top_probs", indices), self._rows("top_ids", indices))
        return self._rows("features", indices), soft


def fingerprint(
    target_dir: Path, kind: str, layout: ReturnHiddenStates, train: SequenceSet
) -> dict[str, Any]:
    """What the features depend on, as JSON values (stored in the file, hashed in its name)."""
    weights = [
        {"file": p.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        for p in sorted(target_dir.glob("*.safetensors"))
        for stat in [p.stat()]
    ]
    return {
        "format": FORMAT,
        "target": str(target_dir.resolve()),
        "weights": weights,
        "kind": kind,
        "layout": asdict(layout),
        "sequences_sha256": train.sha256(),
    }


def load_or_compute(
    data_dir: Path,
    kind: str,
    target_dir: Path,
    features: TargetFeatures,
    train: SequenceSet,
    batch_size: int,
    log: Log,
) -> tuple[CachedFeatures, dict[str, Any]]:
    """The features of ``train`` from the file with the same fingerprint, else computed
    (replacing this kind's older files) and saved; and what the manifest says about them."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    meta = fingerprint(target_dir, kind, features.drafter.target_hidden, train)
    meta["soft_top_k"] = features.top_k
    text = json.dumps(meta, sort_keys=True)
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = data_dir / f"features-{kind}-{key}.safetensors"
    lengths = [len(s) for s in train.sequences]
    start = time.perf_counter()
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            is_match = (f.metadata() or {}).get("fingerprint") == text
        if is_match:
            cache = CachedFeatures(load_file(path), lengths)
            seconds = time.perf_counter() - start
            log(f"target features of {len(train)} sequences read from {path} in {seconds:.0f} s")
            return cache, {"file": str(path), "is_reused": True, "seconds": round(seconds, 1)}
    store = compute(features, train, batch_size)
    for stale in data_dir.glob(f"features-{kind}-*.safetensors"):
        log(f"removing {stale} (features of other weights or sequences)")
        stale.unlink()
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(store, str(tmp), metadata={"fingerprint": text})
    tmp.replace(path)
    seconds = time.perf_counter() - start
    num_tokens, width = store["features"].shape
    size = sum(t.numel() * t.element_size() for t in store.values())
    log(
        f"target features of {len(train)} sequences ({num_tokens} x {width} fp16"
        f"{f', top {features.top_k} next tokens' if features.top_k else ''}, "
        f"{size / 2**30:.2f} GiB) computed in {seconds:.0f} s, saved to {path}"
    )
    return CachedFeatures(store, lengths), {
        "file": str(path),
        "is_reused": False,
        "seconds": round(seconds, 1),
    }


def compute(
    features: TargetFeatures, train: SequenceSet, batch_size: int
) -> dict[str, torch.Tensor]:
    """One pass of the target over ``train``, in batches of neighbours in length (the torch
    backend pads a batch's rows to its longest), in ``train``'s order: "features"
    [num_tokens, F] fp16, and with ``features.top_k`` "top_probs" [num_tokens, k] fp16 and
    "top_ids" [num_tokens, k] int32."""
    offsets = [0, *itertools.accumulate(len(s) for s in train.sequences)]
    order = sorted(range(len(train)), key=lambda i: len(train.sequences[i]))
    store: dict[str, torch.Tensor] = {}
    with tqdm(total=len(train), desc="target features", unit="seq") as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            rows = features.rows([train.sequences[i] for i in chunk])
            columns = {"features": (rows.features, torch.float16)}
            if rows.top_probs is not None and rows.top_ids is not None:
                columns.update(
                    top_probs=(rows.top_probs, torch.float16), top_ids=(rows.top_ids, torch.int32)
                )
            for name, (values, dtype) in columns.items():
                if name not in store:
                    store[name] = torch.empty((offsets[-1], values[0].shape[1]), dtype=dtype)
                for i, row in zip(chunk, values, strict=True):
                    stored = row.to(dtype)
                    if name == "features" and not bool(torch.isfinite(stored).all()):
                        raise ValueError(
                            "feature cache: the target's hidden states overflow fp16; "
                            "train with --no-feature-cache"
                        )
                    store[name][offsets[i] : offsets[i + 1]] = stored
            bar.update(len(chunk))
    return store
