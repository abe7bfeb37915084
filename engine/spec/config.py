"""How a decode worker speculates: which draft, how deep, and how drafts are accepted."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.suffix import SuffixConfig

MAX_DRAFT_TOKENS = 16  # bounded by the RoPE slack past max_seq_len (2K + 3 positions)
ACCEPTANCE_MODES = ("lossless", "synthetic")
MODEL_FREE_KINDS = ("suffix",)  # drafts without a draft model (engine.spec.suffix)
# Draft models read from the target's own files: DeepSeek-V3's MTP layer (drafters.mtp).
TARGET_FILE_KINDS = ("mtp",)


@dataclass(frozen=True)
class SpeculativeConfig:
    # HF-format draft directory (EAGLE, EAGLE-3 or DFlash layout); "" for suffix and mtp
    draft_model: str
    num_draft_tokens: int = 5  # K; a DFlash draft forces its block_size - 1
    # "eagle" | "eagle3" | "dflash" | "suffix" | "mtp"; None: read from the draft config
    kind: str | None = None
    target_layer_ids: tuple[int, ...] | None = None  # EAGLE-3 taps, overriding the config
    adaptive: bool = False  # choose K per step (0..K) from measured costs and acceptance
    sample_drafts: bool = False  # sampled rows draft by sampling q instead of its argmax
    acceptance: str = "lossless"  # "synthetic": benchmark mode, NOT lossless
    synthetic_acceptance_rates: tuple[float, ...] = ()  # per position, for "synthetic"
    suffix: SuffixConfig = field(default_factory=SuffixConfig)  # kind "suffix": its matching
    # Ranks a draft model splits over beside a split Llama-3 target: None, the target's
    # (engine.spec.split_draft); 1, rank 0 alone (a whole copy of the embedding and LM
    # head there). DeepSeek-V3's drafts run on rank 0 alone.
    draft_tensor_parallel_size: int | None = None

    @property
    def is_model_free(self) -> bool:
        return self.kind in MODEL_FREE_KINDS

    @property
    def reads_target_files(self) -> bool:
        return self.kind in TARGET_FILE_KINDS

    def __post_init__(self) -> None:
        if self.reads_target_files and self.draft_model:
            raise ValueError(
                f"draft_model: kind {self.kind!r} reads its layer from the target's own files; "
                f"give no draft directory (got {self.draft_model!r})"
            )
        if self.is_model_free and self.draft_model:
            raise ValueError(
                f"draft_model: kind {self.kind!r} drafts without a model; combining it with "
                f"the draft {self.draft_model!r} is not built yet"
            )
        if not (self.is_model_free or self.reads_target_files) and not self.draft_model:
            raise ValueError(f"draft_model: kind {self.kind!r} needs a draft directory")
        if self.is_model_free and self.sample_drafts:
            raise ValueError(
                f"sample_drafts: kind {self.kind!r} proposes tokens, not a distribution"
            )
        size = self.draft_tensor_parallel_size
        if size is not None and size < 1:
            raise ValueError(f"draft_tensor_parallel_size: {size}, must be at least 1")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"num_draft_tokens: must be in 1..{MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}"
            )
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(
                f"acceptance: {self.acceptance!r} is not allowed; allowed: {list(ACCEPTANCE_MODES)}"
            )
        if self.acceptance == "synthetic":
            rates = self.synthetic_acceptance_rates
            if len(rates) < self.num_draft_tokens or not all(0 <= r <= 1 for r in rates):
                raise ValueError(
                    "synthetic_acceptance_rates: need one probability in [0, 1] per draft "
                    f"position ({self.num_draft_tokens}), got {list(rates)}"
                )
