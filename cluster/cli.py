"""`tandem serve`: the whole cluster on this machine with one command."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any


def register_serve(subparsers: Any) -> None:
    """Add `tandem serve`."""
    parser = subparsers.add_parser(
        "serve",
        help="run a whole cluster here (redis, prefill and decode workers, router)",
        description="Start an embedded redis-server (unless --redis-url), N prefill and M "
        "decode worker processes and the router, sharing this machine's cores. Prints the "
        "router's address once everything is SERVING; Ctrl-C or SIGTERM drains and stops.",
    )
    parser.add_argument("--model", required=True, help="HF model directory or a prepared name")
    parser.add_argument("--draft", metavar="DIR", help="EAGLE / EAGLE-3 / DFlash draft directory")
    parser.add_argument("--num-draft-tokens", type=int, default=5, help="K, drafts per step")
    parser.add_argument("--prefill", type=int, default=1, help="prefill worker processes")
    parser.add_argument("--decode", type=int, default=1, help="decode worker processes")
    parser.add_argument("--redis-url", help="an existing Redis (default: start one)")
    parser.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    parser.add_argument("--port", type=int, default=50050, help="the router's port")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: shared)")
    parser.add_argument("--kv-cache-memory", type=int, help="KV cache bytes per worker")
    parser.add_argument("--block-size", type=int, help="tokens per KV block")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument("--log-dir", help="write each process's log there (default: stderr)")
    parser.add_argument("--grace-s", type=float, default=30.0, help="drain time on shutdown")
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cluster.launcher import Cluster, ClusterError, ClusterSpec
    from engine.model_store import ModelNotFoundError, resolve_model

    try:
        model = str(resolve_model(args.model))
    except ModelNotFoundError as e:
        print(f"tandem serve: error: {e}", file=sys.stderr)
        return 2
    worker_args = ["--dtype", args.dtype]
    for option, value in (
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--block-size", args.block_size),
        ("--max-model-len", args.max_model_len),
    ):
        if value is not None:
            worker_args += [option, str(value)]
    router_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    spec = ClusterSpec(
        model=model,
        draft=args.draft,
        num_draft_tokens=args.num_draft_tokens,
        num_prefill=args.prefill,
        num_decode=args.decode,
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        threads=args.threads,
        worker_args=tuple(worker_args),
        router_args=tuple(router_args),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        grace_s=args.grace_s,
    )
    cluster = Cluster(spec)
    try:
        cluster.start()  # Ctrl-C meanwhile: KeyboardInterrupt, and start() stops what it began
    except ClusterError as e:
        print(f"tandem serve: error: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(cluster.router_address, flush=True)
    print(
        f"tandem serve: router at {cluster.router_address}, {spec.num_prefill} prefill + "
        f"{spec.num_decode} decode workers, redis {cluster.redis_url}; Ctrl-C stops",
        file=sys.stderr,
    )
    rc = 0
    try:
        while not stop.wait(1.0):
            dead = cluster.dead_components()
            if dead:
                names = ", ".join(f"{c.name} (exit {c.process.returncode})" for c in dead)
                print(f"tandem serve: stopping, died: {names}", file=sys.stderr)
                rc = 1
                break
    finally:
        print("tandem serve: draining and stopping", file=sys.stderr)
        cluster.stop()
    return rc
