"""A tiny DeepSeek-V3 through the disaggregated cluster (`tandem serve`: router, prefill and
decode worker processes, a real Redis) with each EAGLE-3 draft of issue 25: the MLA draft
(its pools in the target's latent layout) and the MHA draft (its own K/V pools beside the
target's latent ones); and with its own MTP layer (`--draft-method mtp`, no draft
directory). The prefill worker pushes MLA blocks; greedy output and the decode worker's
draft counters equal one offline engine's, token for token, in fp32."""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.deepseek_v3_config import DeepseekV3Config
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from serving.launcher import Cluster
from tests.engine.tiny_deepseek import (
    build_tiny_deepseek,
    build_tiny_deepseek_with_mtp,
    make_mtp_know_the_target,
)
from tests.engine.tiny_drafts import build_random_draft
from tests.services.cluster_helpers import (
    TINY_VOCAB,
    generate_all,
    metric,
    tiny_cluster_spec,
    worker_stats,
)
from tests.services.tiny_tokenizer import save_char_tokenizer
from training.recipes import mha_fields

K = 3
BLOCK_SIZE = 4  # cluster_helpers.TINY_WORKER_ARGS
MAX_TOKENS = 16
# Seeds and scales of random drafts that get some drafts accepted on PROMPTS.
DRAFTS = {"mla": dict(seed=0, std=0.3), "mha": dict(seed=2, std=0.1)}
rng = random.Random(0)
PROMPTS = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(3)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny DeepSeek-V3 (q-LoRA, YaRN, MoE; character tokenizer) and its two drafts."""
    torch.set_num_threads(1)  # this process shares the cores with the clusters'
    out = tmp_path_factory.mktemp("cluster_dsv3")
    target = out / "target"
    build_tiny_deepseek(
        target, "qlora_yarn_mscale_interleaved", vocab_size=TINY_VOCAB, num_layers=2
    )
    save_char_tokenizer(target, TINY_VOCAB)
    hf = json.loads((target / "config.json").read_text())
    build_random_draft(target, out / "mla", "eagle3", **DRAFTS["mla"])  # type: ignore[arg-type]
    build_random_draft(target, out / "mha", "eagle3", **DRAFTS["mha"], **mha_fields(hf))  # type: ignore[arg-type]
    mtp = out / "mtp_target"  # a target with an MTP layer whose drafts are accepted
    build_tiny_deepseek_with_mtp(
        mtp, "qlora_yarn_mscale_interleaved", vocab_size=TINY_VOCAB, num_layers=2
    )
    make_mtp_know_the_target(mtp)
    save_char_tokenizer(mtp, TINY_VOCAB)
    return {"target": target, "mla": out / "mla", "mha": out / "mha", "mtp": mtp}


@pytest.fixture(scope="module")
def clusters(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Cluster]]:
    """One cluster per draft, started side by side; KV over the gRPC stream for the MLA
    draft and through shared memory for the MHA draft."""

    def start(variant: str, transport: str) -> Cluster:
        is_mtp = variant == "mtp"
        spec = tiny_cluster_spec(
            model_dirs["mtp" if is_mtp else "target"],
            tmp_path_factory.mktemp(f"logs_{variant}"),
            draft=None if is_mtp else str(model_dirs[variant]),
            draft_method="mtp" if is_mtp else None,
            num_draft_tokens=K,
            adaptive_speculation=False,  # K every step: counters as one engine's
            worker_args=(
                *("--dtype", "float32", "--block-size", str(BLOCK_SIZE)),
                *("--kv-cache-memory", str(4 << 20), "--kv-transport", transport),
            ),
        )
        return Cluster(spec).start(timeout_s=120)

    variants = (("mla", "grpc"), ("mha", "auto"), ("mtp", "grpc"))
    with ThreadPoolExecutor(len(variants)) as pool:
        futures = {v: pool.submit(start, v, t) for v, t in variants}
        try:
            yield {variant: future.result() for variant, future in futures.items()}
        finally:
            for future in futures.values():  # each one that started, even if another failed
                with contextlib.suppress(Exception):
                    future.result().stop()


def offline(target: Path, draft: Path | None) -> tuple[list[list[int]], LLMEngine]:
    """Greedy tokens of PROMPTS from one in-process engine with ``draft`` (None: the
    target's MTP layer), and the engine."""
    engine = LLMEngine(
        EngineConfig(
            model=str(target),
            dtype="float32",
            block_size=BLOCK_SIZE,
            kv_cache_memory=4 << 20,
            num_threads=1,
            speculative=SpeculativeConfig(
                str(draft or ""), num_draft_tokens=K, kind=None if draft else "mtp"
            ),
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(PROMPTS))], engine


def block_bytes(target: Path, draft: Path | None) -> int:
    """Bytes of one block id over every layer in fp32: the target's one latent+rope pool
    per layer, and the draft's one (MLA, MTP) or two (K and V) pools."""
    target_hf = json.loads((target / "config.json").read_text())
    draft_hf = json.loads((draft / "config.json").read_text()) if draft else target_hf
    mla = DeepseekV3Config.from_hf(target_hf)
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    if draft_hf.get("kv_lora_rank"):
        draft_bytes = draft_hf["kv_lora_rank"] + draft_hf["qk_rope_head_dim"]
    else:
        draft_bytes = 2 * draft_hf["num_key_value_heads"] * draft_hf["head_dim"]
    return 4 * BLOCK_SIZE * (mla.num_hidden_layers * latent + draft_bytes)


@pytest.mark.parametrize("variant", ["mla", "mha", "mtp"])
async def test_greedy_through_the_cluster_equals_the_offline_engine(
    clusters: dict[str, Cluster], model_dirs: dict[str, Path], variant: str
) -> None:
    cluster = clusters[variant]
    target = model_dirs["mtp" if variant == "mtp" else "target"]
    draft = None if variant == "mtp" else model_dirs[variant]
    ours = await generate_all(cluster.router_address, PROMPTS, max_tokens=MAX_TOKENS)
    refs, engine = offline(target, draft)
    assert ours == refs
    # The decode worker drafted from the draft KV and drafts the prefill worker sent: as
    # many drafts, and as many accepted, as one engine doing everything.
    assert engine.spec is not None
    expected = engine.spec.stats
    stats = (await worker_stats(cluster.decode[0])).speculative
    assert expected.num_accepted_tokens > 0
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (
        expected.num_draft_tokens,
        expected.num_accepted_tokens,
    )
    # What travelled: every block that holds each prompt's KV, whole (not the decode
    # worker's lookahead blocks), in the MLA layout (one latent+rope vector per token and
    # target layer, then the draft's).
    pushed = metric(cluster.prefill[0], "tandem_kv_transfer_bytes_total", "prefill")
    filled = sum(-(-len(p) // BLOCK_SIZE) for p in PROMPTS)
    assert pushed == filled * block_bytes(target, draft)
    # MLA over the gRPC stream, MHA through shared-memory rings (same host, auto).
    assert bool(shm_rings(cluster)) == (variant == "mha")


def shm_rings(cluster: Cluster) -> list[str]:
    """The shared-memory rings the prefill worker keeps after its pushes (memfds)."""
    fds = Path(f"/proc/{cluster.prefill[0].process.pid}/fd")
    links = [os.readlink(fd) for fd in fds.iterdir()]
    return [link for link in links if link.startswith("/memfd:tandem-kv-ring")]
