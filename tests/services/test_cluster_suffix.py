"""Suffix decoding through a real cluster (1 prefill + 1 decode worker, a tiny fp32 target,
real Redis, loopback gRPC), as `tandem serve --draft-method suffix` starts it: no draft
model anywhere; the decode worker proposes from each request's tokens and recent outputs,
and greedy output equals the target alone, token for token."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serving.launcher import Cluster
from tests.services.cluster_helpers import (
    TINY_WORKER_ARGS,
    build_tiny_target,
    check_stream,
    engine_greedy,
    run,
    tiny_cluster_spec,
)
from tests.services.test_cluster_adaptive import k_histogram
from tests.services.test_cluster_tiny import prompts

K = 4
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("cluster_suffix")
    target = build_tiny_target(out / "target")
    spec = tiny_cluster_spec(
        target,
        out / "logs",
        draft_method="suffix",
        num_draft_tokens=K,
        worker_args=(*TINY_WORKER_ARGS, "--kv-cache-memory", str(24 << 20), "--max-num-seqs", "8"),
    )
    assert spec.draft is None and spec.adaptive_speculation
    running = Cluster(spec).start(timeout_s=180)
    try:
        yield running, target
    finally:
        running.stop()


async def test_greedy_with_suffix_drafts_equals_the_target_alone(
    cluster: tuple[Cluster, Path],
) -> None:
    running, target = cluster
    assert running.router is not None
    # Prompts that quote themselves, as edits do: their ends recur earlier in them.
    token_prompts = [p + p[: len(p) // 2] for p in prompts(6, seed=21)]
    results = await asyncio.gather(
        *(
            run(running.router.address, p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            for p in token_prompts
        )
    )
    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert ours == engine_greedy(target, token_prompts, MAX_TOKENS)  # lossless, exactly

    accepted = 0
    for chunks in results:
        usage = chunks[-1].usage
        assert usage.HasField("speculative")
        spec = usage.speculative
        steps = spec.num_drafts + spec.num_steps_without_drafts
        # the prefill worker sampled the first token; each decode step emits its accepted
        # drafts and one more, the last step's cut at max_tokens
        assert 0 <= spec.num_accepted_tokens + steps - (usage.completion_tokens - 1) <= K
        assert spec.num_accepted_tokens <= spec.num_draft_tokens <= K * spec.num_drafts
        accepted += spec.num_accepted_tokens
    assert accepted > 0  # the matches paid somewhere

    # The decode worker's steps by the K they verified: 0 (no row had a match) to K.
    [decode] = running.decode
    with urllib.request.urlopen(decode.metrics_url, timeout=5) as response:
        buckets, count, total = k_histogram(response.read().decode(), K)
    assert buckets == sorted(buckets) and buckets[-1] == count > 0
    assert 0 < total <= K * count


async def test_a_later_request_drafts_from_an_earlier_ones_output(
    cluster: tuple[Cluster, Path],
) -> None:
    """A prompt ending in the start of an earlier output continues as that output did,
    and most of it is drafted and accepted (through the decode worker's shared index; its
    own tokens may match too where the tiny target loops: tests/engine/spec/test_suffix.py
    isolates the shared index)."""
    running, target = cluster
    assert running.router is not None
    [prompt] = prompts(1, seed=22)
    first = await run(
        running.router.address, prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    output = check_stream(first, MAX_TOKENS)
    # A new prompt whose greedy continuation is the earlier output's, from token 8 on.
    again = prompt + output[:8]
    second = await run(
        running.router.address, again, max_tokens=16, temperature=0.0, ignore_eos=True
    )
    assert check_stream(second, 16) == output[8:24] == engine_greedy(target, [again], 16)[0]
    spec = second[-1].usage.speculative
    assert spec.num_accepted_tokens >= 8  # most of it was proposed and accepted
