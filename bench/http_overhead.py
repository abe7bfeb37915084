"""The OpenAI HTTP API against gRPC, through the same router, in one run.

The same greedy streaming requests (``--max-tokens`` each, EOS ignored, distinct prompts
of the committed held-out chat texts as token ids) go through the SDK (gRPC,
``AsyncTandemClient.stream``) and through the official ``openai`` client (HTTP,
``/v1/completions`` with ``stream=True``), ``--concurrency`` at a time, in rounds that
alternate which protocol goes first, so that both see the same machine and the same
prefix-cache state. Throughput is output tokens over the wall time of a protocol's rounds;
TTFT is from sending a request to its first token, as its client sees it (the ``openai``
client parses every event, as its users' code does).

Starts its own cluster (``--model``, bf16, router + 1 prefill + 1 decode worker, embedded
Redis) unless given ``--router`` and ``--base-url`` of a running one. Target:
``http_over_grpc`` >= 0.95, and HTTP's TTFT p50 within 5 ms of gRPC's.

The last line is one JSON object: ``{"grpc_tok_s", "http_tok_s", "http_over_grpc",
"grpc_ttft_ms_p50", "http_ttft_ms_p50"}`` plus the setup.

    python bench/http_overhead.py            # 32 requests, 128 tokens, concurrency 8
    python bench/http_overhead.py --quick    # 16 requests (about 2 minutes here)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tandem_client import AsyncTandemClient  # noqa: E402

KV_CACHE_MEMORY = 512 << 20
PROMPT_TOKENS = 96


def prompts(model_dir: Path, count: int) -> list[list[int]]:
    """``count`` distinct prompts of ``PROMPT_TOKENS`` tokens from the held-out chat set."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stream: list[int] = []
    for line in (ROOT / "training" / "heldout" / "chat.jsonl").read_text().splitlines():
        stream += tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=False).ids
    while len(stream) < PROMPT_TOKENS * count:
        stream += stream
    return [stream[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(count)]


Send = Callable[[list[int]], Awaitable[tuple[float, int]]]  # -> (TTFT s, tokens)


def grpc_sender(client: AsyncTandemClient, max_tokens: int) -> Send:
    async def send(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        ttft, count = 0.0, 0
        async for chunk in client.stream(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            if not count:
                ttft = time.perf_counter() - start
            count += len(chunk.token_ids)
        return ttft, count

    return send


def http_sender(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> Send:
    async def send(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        ttft, count = 0.0, 0
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for event in stream:
            if event.choices and event.choices[0].text and not ttft:
                ttft = time.perf_counter() - start
            if event.usage is not None:
                count = event.usage.completion_tokens
        return ttft, count

    return send


async def one_round(send: Send, batch: list[list[int]]) -> tuple[float, list[float], int]:
    """A batch at once: (wall time s, TTFTs s, tokens)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(send(p) for p in batch))
    return time.perf_counter() - start, [t for t, _ in results], sum(n for _, n in results)


async def measure(
    router: str, base_url: str, model: str, batches: list[list[list[int]]], max_tokens: int
) -> dict[str, dict[str, float]]:
    totals = {name: {"wall_s": 0.0, "tokens": 0.0} for name in ("grpc", "http")}
    ttfts: dict[str, list[float]] = {"grpc": [], "http": []}
    async with (
        AsyncTandemClient(router, timeout=600) as grpc_client,
        openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as http_client,
    ):
        senders = {
            "grpc": grpc_sender(grpc_client, max_tokens),
            "http": http_sender(http_client, model, max_tokens),
        }
        for send in senders.values():  # warm-up: connections, first requests
            await one_round(send, batches[0][:2])
        for i, batch in enumerate(tqdm(batches, desc="rounds", unit="round")):
            order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
            for name in order:
                wall, round_ttfts, tokens = await one_round(senders[name], batch)
                totals[name]["wall_s"] += wall
                totals[name]["tokens"] += tokens
                ttfts[name] += round_ttfts
    return {
        name: {
            "tok_s": totals[name]["tokens"] / totals[name]["wall_s"],
            "ttft_ms_p50": 1000 * statistics.median(ttfts[name]),
            "tokens": totals[name]["tokens"],
        }
        for name in totals
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="prepared name or HF directory")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--requests", type=int, default=32, help="requests per protocol")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--quick", action="store_true", help="16 requests per protocol")
    parser.add_argument("--router", help="a running router's gRPC address (with --base-url)")
    parser.add_argument("--base-url", help="its OpenAI API, e.g. http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    if bool(args.router) != bool(args.base_url):
        parser.error("--router and --base-url go together")
    if args.quick:
        args.requests = 16

    from router.models import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    every = prompts(model_dir, args.requests)
    batches = [every[i : i + args.concurrency] for i in range(0, len(every), args.concurrency)]
    with ExitStack() as stack:
        router, base_url = args.router, args.base_url
        if router is None:
            from serving.launcher import Cluster, ClusterSpec

            spec = ClusterSpec(
                model=str(model_dir),
                port=0,
                worker_args=("--dtype", args.dtype, "--kv-cache-memory", str(KV_CACHE_MEMORY)),
                service_args=("--log-level", "WARNING"),
                is_metrics_served=False,
                eager=True,  # the router's two front ends share the workers: eager is fair
            )
            print("starting the cluster: router + 1 prefill + 1 decode", file=sys.stderr)
            cluster = stack.enter_context(Cluster(spec))
            assert cluster.router is not None
            router, base_url = cluster.router_address, cluster.router.base_url
        served = openai.OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id
        result = asyncio.run(measure(router, base_url, served, batches, args.max_tokens))
    grpc, http = result["grpc"], result["http"]
    print(f"\n{'':6} {'tok/s':>8} {'TTFT p50 ms':>12}", file=sys.stderr)
    for name, figures in result.items():
        print(f"{name:6} {figures['tok_s']:>8.1f} {figures['ttft_ms_p50']:>12.1f}", file=sys.stderr)
    print(
        json.dumps(
            {
                "grpc_tok_s": round(grpc["tok_s"], 1),
                "http_tok_s": round(http["tok_s"], 1),
                "http_over_grpc": round(http["tok_s"] / grpc["tok_s"], 3),
                "grpc_ttft_ms_p50": round(grpc["ttft_ms_p50"], 1),
                "http_ttft_ms_p50": round(http["ttft_ms_p50"], 1),
                "setup": {
                    "model": args.model,
                    "dtype": args.dtype,
                    "requests": args.requests,
                    "max_tokens": args.max_tokens,
                    "concurrency": args.concurrency,
                    "cores": os.cpu_count(),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
