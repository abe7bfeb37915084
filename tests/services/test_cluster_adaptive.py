"""Adaptive speculation through a real cluster (1 prefill + 1 decode worker, a tiny fp32
target and a random EAGLE-3 draft, real Redis, loopback gRPC), as `tandem serve` starts it
by default: greedy output equals the target alone, token for token; each request's usage
says how many of its steps ran without drafts; the decode worker's `tandem_spec_k`
histogram counts its steps by the K they verified."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serving.launcher import Cluster
from tests.engine.tiny_drafts import build_random_draft
from tests.services.cluster_helpers import (
    TINY_WORKER_ARGS,
    build_tiny_target,
    check_stream,
    engine_greedy,
    run,
    tiny_cluster_spec,
)
from tests.services.test_cluster_tiny import prompts

K = 3
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("cluster_adaptive")
    target = build_tiny_target(out / "target")
    # As test_cluster_tiny's: a seed and scale with which some drafts are accepted.
    build_random_draft(target, out / "eagle3", "eagle3", seed=1, std=0.3)
    spec = tiny_cluster_spec(
        target,
        out / "logs",
        draft=str(out / "eagle3"),
        num_draft_tokens=K,  # the bound: adaptive is the default
        worker_args=(*TINY_WORKER_ARGS, "--kv-cache-memory", str(24 << 20), "--max-num-seqs", "8"),
    )
    assert spec.adaptive_speculation and "--no-adaptive-speculation" not in spec.engine_args()
    running = Cluster(spec).start(timeout_s=180)
    try:
        yield running, target
    finally:
        running.stop()


def k_histogram(text: str, max_k: int = K) -> tuple[list[float], float, float]:
    """The decode worker's ``tandem_spec_k``: cumulative counts at le=0..K, count, sum."""

    def sample(name: str, labels: str = "") -> float:
        found = re.search(
            rf'^tandem_spec_k_{name}\{{{re.escape(labels)}role="decode"\}} (\S+)$', text, re.M
        )
        assert found, f"tandem_spec_k_{name}{{{labels}...}} missing"
        return float(found.group(1))

    buckets = [sample("bucket", f'le="{float(k)}",') for k in range(max_k + 1)]
    assert sample("bucket", 'le="+Inf",') == buckets[-1]
    return buckets, sample("count"), sample("sum")


async def test_greedy_with_adaptive_k_equals_the_target_alone(
    cluster: tuple[Cluster, Path],
) -> None:
    """Runs first: the decode worker's steps are this test's alone."""
    running, target = cluster
    assert running.router is not None
    token_prompts = prompts(6, seed=11)
    results = await asyncio.gather(
        *(
            run(running.router.address, p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            for p in token_prompts
        )
    )
    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert ours == engine_greedy(target, token_prompts, MAX_TOKENS)  # lossless, exactly

    row_steps = 0
    for chunks in results:
        usage = chunks[-1].usage
        assert usage.HasField("speculative")
        spec = usage.speculative
        steps = spec.num_drafts + spec.num_steps_without_drafts
        # the prefill worker sampled the first token; each decode step emits its accepted
        # drafts and one more, the last step's cut at max_tokens
        emitted = spec.num_accepted_tokens + steps
        assert 0 <= emitted - (usage.completion_tokens - 1) <= K
        assert spec.num_draft_tokens <= K * spec.num_drafts
        row_steps += steps

    [decode] = running.decode
    with urllib.request.urlopen(decode.metrics_url, timeout=5) as response:
        buckets, count, total = k_histogram(response.read().decode())
    assert buckets == sorted(buckets) and buckets[-1] == count
    # one observation per decode step of the batch, which carries 1 to 6 of the rows
    assert row_steps / 6 <= count <= row_steps
    assert 0 <= total <= K * count


async def test_a_request_that_does_not_speculate_verifies_no_drafts(
    cluster: tuple[Cluster, Path],
) -> None:
    """``speculative=False`` on the wire: beside a request that speculates, its rows verify
    no drafts, its usage says so, and both outputs are the target's."""
    running, target = cluster
    assert running.router is not None
    token_prompts = prompts(2, seed=12)
    results = await asyncio.gather(
        *(
            run(
                running.router.address,
                p,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
                speculative=on,
            )
            for p, on in zip(token_prompts, (True, False), strict=True)
        )
    )
    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert ours == engine_greedy(target, token_prompts, MAX_TOKENS)
    off = results[1][-1].usage.speculative
    assert (off.num_drafts, off.num_draft_tokens, off.num_accepted_tokens) == (0, 0, 0)
    assert off.num_steps_without_drafts == MAX_TOKENS - 1  # the prefill worker sampled one
