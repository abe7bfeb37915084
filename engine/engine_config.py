"""How an engine is set up: the model, its dtype, the KV cache and the scheduler's limits."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec.config import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "hand_back")
KERNELS = ("auto", "torch", "triton")  # EngineConfig.kernels
CPU_GEMM = ("measured", "kernel", "onednn", "aten")  # EngineConfig.cpu_gemm
FP8_WEIGHTS = ("auto", "dequantize", "keep")  # EngineConfig.fp8_weights


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF model directory
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # bytes (per rank when split); default: kv_cache_memory_fraction of total, per rank
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.1
    enable_prefix_caching: bool = True
    device: str = "cpu"
    attention_backend: str = "auto"  # engine.attention.BACKENDS; auto: by device (torch on CPU)
    # The element-wise layers (RMSNorm with its residual add, RoPE, SiLU-and-mul) and the
    # sampler's filters, draws and rejection sampling: "torch" or "triton"
    # (KERNELS); auto: triton where attention runs on the GPU path
    # (the triton or flash_attn backend, also as auto's pick on CUDA), else torch.
    kernels: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # CPU: the product each Linear runs (engine/models/layers.py): "measured" picks the
    # fastest per weight shape and row bucket from timings taken once per machine and
    # cached (kernels/cpu/gemm_timings.py); "kernel", "onednn" or "aten" runs one
    # wherever it can. "aten" prepares nothing.
    cpu_gemm: str = "measured"
    # CPU: build the C++ kernels (kernels/cpu/extension.py) where missing or stale. False
    # (serving workers): load a prebuilt one only, else run on aten (logged in one line).
    build_cpu_kernels: bool = True
    # A block-FP8 checkpoint's projections (engine/fp8.py): "dequantize" them once at load
    # time into bf16 (or the dtype's) weights that the packed products run, or "keep" them
    # FP8 in memory (half of bf16): W8A8 products on the Triton kernels' path
    # (kernels/triton/fp8_gemm.py), else each product dequantizes its weight
    # (kernels/cpu/fp8_dequant.cpp). auto: keep where the Triton kernels run, else dequantize
    # (engine.components.fp8_weights_for).
    fp8_weights: str = "auto"
    speculative: SpeculativeConfig | None = None  # draft model and how to speculate
    # When blocks run out mid-decode, the newest request is preempted: "recompute" keeps it
    # waiting here to be prefilled again; "hand_back" (decode workers) ends it with
    # FinishReason.PREEMPTED so that the router re-prefills it elsewhere and resumes it.
    preemption: str = "recompute"
    # Decode steps (and speculative verification) through torch.compile: faster at small
    # batches (bench/RESULTS.md). Compiling is paid at start-up by a short warm-up
    # generation, so no request waits for it.
    torch_compile: bool = False
    # Compiled steps call their kernels through inductor's C++ wrapper, not its Python one
    # (engine.executor.uniproc.compile_decode_model): faster steps, a first compile 4-5x
    # as long from a cold inductor cache.
    compile_cpp_wrapper: bool = False
    # A short generation at start-up (greedy and sampled rows, speculating where a draft is
    # set), so that no request pays for lazy initialization; always with torch_compile.
    # Serving workers set it: it runs before their health turns SERVING.
    warm_up: bool = False
    # Speculative decode steps through CUDA graphs, one per batch bucket up to
    # max_num_seqs (engine.spec.graph_runner); None: on CUDA only. One block is kept back
    # as the padded rows' scratch block.
    cuda_graphs: bool | None = None
    # Overlap scheduling (engine.spec.overlap): a decode step is launched before the
    # previous step's tokens are read, so that the host's postprocessing and scheduling
    # overlap the device's step. Speculative decode steps on the graph runner (cuda_graphs),
    # K chosen per launched step with adaptive speculation; rows with a grammar, logprobs,
    # penalties or logit bias make the engine read the step in flight first and run as
    # without it. Same tokens either way.
    enable_overlap_scheduler: bool = False
    # Structured output (engine.structured): a constraint that takes longer to compile is
    # refused (INVALID_ARGUMENT); compiled grammars kept, least recently used dropped first.
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 64
    # Ranks a Llama-3 or DeepSeek-V3 target is split over (engine.parallel), each in a
    # process of its own (engine.executor: this one is rank 0); with CUDA graphs, each
    # rank captures its own (engine.executor.graph_steps).
    tensor_parallel_size: int = 1
    # A mixture of experts split over the ranks: its routed experts whole, a share per
    # rank (expert parallelism), rather than every expert's channels (engine.models.moe).
    enable_expert_parallel: bool = False
    # Data-parallel attention (DeepSeek-V3): this many data-parallel ranks, each attending
    # its own requests' rows over its own KV pool, the experts split over every rank
    # (engine.dp_blocks, engine.models.moe.DataParallelStep). With tensor_parallel_size
    # above 1, each is that many ranks, its attention split by heads over them
    # (engine.parallel.group.DataParallelLayout): data_parallel_size x tensor_parallel_size
    # ranks in all.
    data_parallel_size: int = 1
    # LoRA adapters (PEFT's format) served beside the model, by name: (name, directory)
    # pairs (engine.lora). A request names one, or none; drafts stay the base model's.
    # Compiled steps take the deltas as an opaque op (not CUDA graphs); split over
    # tensor-parallel ranks as the model is.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Adapters may be loaded at run time (LLMEngine.load_lora), also without lora_modules.
    enable_lora: bool = False
    max_lora_rank: int = 64  # adapters of a higher rank are refused
    # Adapters whose weights stay in memory; the others are read again when a request
    # names one, in place of the least recently used without requests. None: every one.
    max_cpu_loras: int | None = None
    # Adapters one step runs, the earliest requests' (running or waiting): requests under
    # others sit steps out (engine.scheduler); None: no bound.
    max_loras: int | None = 8

    @property
    def uses_cuda_graphs(self) -> bool:
        on = self.device.startswith("cuda") if self.cuda_graphs is None else self.cuda_graphs
        return on and self.speculative is not None and not self.speculative.is_model_free

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels: {self.kernels!r} is not one of {', '.join(KERNELS)}")
        if self.cpu_gemm not in CPU_GEMM:
            raise ValueError(f"cpu_gemm: {self.cpu_gemm!r} is not one of {', '.join(CPU_GEMM)}")
        if self.fp8_weights not in FP8_WEIGHTS:
            raise ValueError(
                f"fp8_weights: {self.fp8_weights!r} is not one of {', '.join(FP8_WEIGHTS)}"
            )
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption: {self.preemption!r} is not one of {', '.join(PREEMPTION_MODES)}"
            )
        spec = self.speculative
        if self.cuda_graphs and spec is not None and spec.is_model_free:
            raise ValueError(
                f"cuda_graphs: {spec.kind} drafts verify rows of different lengths eagerly; "
                "leave cuda_graphs unset"
            )
        if self.enable_overlap_scheduler:
            self._check_overlap()
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size: {self.tensor_parallel_size}, must be at least 1"
            )
        draft_size = spec.draft_tensor_parallel_size if spec is not None else None
        if draft_size not in (None, 1, self.tensor_parallel_size):
            raise ValueError(
                f"speculative.draft_tensor_parallel_size: {draft_size}; a draft splits over "
                f"its target's {self.tensor_parallel_size} ranks or runs on rank 0 alone (1)"
            )
        self._check_data_parallel()
        self._check_lora()

    def _check_lora(self) -> None:
        """What LoRA adapters run with for now."""
        if not self.lora_modules and not self.enable_lora:
            return
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: names repeat: {names}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: {self.max_lora_rank}, must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras: {self.max_cpu_loras}, must be at least 1")
        why = ""
        if self.data_parallel_size > 1:
            why = "data-parallel ranks"
        elif self.uses_cuda_graphs:
            why = "CUDA graphs (the deltas run Python between kernels); turn them off"
        if why:
            raise ValueError(f"lora_modules: adapters do not run with {why} yet")

    @property
    def world_size(self) -> int:
        """Every rank of the engine: data-parallel ranks times tensor-parallel ones."""
        return self.tensor_parallel_size * self.data_parallel_size

    def _check_data_parallel(self) -> None:
        """What data-parallel attention covers for now."""
        size = self.data_parallel_size
        if size < 1:
            raise ValueError(f"data_parallel_size: {size}, must be at least 1")
        why = ""
        if size == 1:
            return
        if self.speculative is not None and self.speculative.is_model_free:
            why = f"{self.speculative.kind} drafts (only draft models run beside each rank's rows)"
        elif self.uses_cuda_graphs or self.enable_overlap_scheduler:
            why = "CUDA graphs (compiled steps run, not captured ones yet); turn them off"
        if why:
            raise ValueError(f"data_parallel_size: {size} does not run with {why}")

    def _check_overlap(self) -> None:
        """What overlap scheduling covers: the graph runner's decode steps of model drafts."""
        spec, why = self.speculative, ""
        if spec is None:
            why = "needs speculative decoding (a draft model)"
        elif spec.is_model_free:
            why = f"does not support {spec.kind} drafts (their lengths vary per row)"
        elif not self.uses_cuda_graphs:
            why = "needs the graph runner (cuda_graphs: on by default on CUDA, True on CPU)"
        elif spec.sample_drafts:
            why = "does not support sampled drafts (speculative.sample_drafts)"
        if why:
            raise ValueError(f"enable_overlap_scheduler: {why}")
