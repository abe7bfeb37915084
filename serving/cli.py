"""`tandem serve`: the whole cluster on this machine with one command (`tandem ledger
audit`: serving.ledger_cli)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from engine.engine_config import FP8_WEIGHTS
from ledger.redis_connect import add_redis_arguments
from serving.auth import add_auth_token_argument, add_cluster_secret_argument
from serving.engine_setup import add_model_arguments, add_speculation_arguments
from serving.lora_setup import add_lora_arguments, lora_flags

if TYPE_CHECKING:
    from serving.launcher import ClusterSpec


def register_serve(subparsers: Any) -> None:
    """Add `tandem serve`."""
    parser = subparsers.add_parser(
        "serve",
        help="run a whole cluster here (redis, prefill and decode workers, router)",
        description="Start an embedded redis-server (unless --redis-url), N prefill and M "
        "decode worker processes and the router, sharing this machine's cores. Prints the "
        "router's address once everything is SERVING; Ctrl-C or SIGTERM drains and stops. "
        "A worker that dies is restarted (with growing pauses, within a budget); when the "
        "router, the embedded Redis or a worker past its budget dies, everything stops. "
        "With --auth-token-file, clients must send that token, and the processes share a "
        "cluster secret and the embedded Redis a password (given or random, handed over in "
        "their environment).",
    )
    add_model_arguments(parser)
    add_speculation_arguments(parser)
    add_lora_arguments(parser)
    parser.add_argument(
        "--prefill", type=int, help="prefill worker processes (default: 1; 0 with --colocate)"
    )
    parser.add_argument("--decode", type=int, default=1, help="decode worker processes")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="one machine: co-located workers (`tandem colocated`: a prefill and a decode "
        "worker in one process over one engine, the KV computed straight into the blocks "
        "reserved for decoding) instead of decode workers, and no prefill workers; each gets "
        "the cores the prefill workers would have had; disaggregation, the default, is the "
        "cluster's shape across machines",
    )
    add_redis_arguments(
        parser,
        required=False,
        url_help="an existing Redis (default: start one): redis://HOST:PORT/DB, rediss://... "
        "for TLS, or unix://PATH; the password goes to the workers in their environment, "
        "never on their command lines",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the router listens on (gRPC and HTTP)"
    )
    parser.add_argument("--port", type=int, default=50050, help="the router's port")
    parser.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="address the prefill and decode workers listen on (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address every process's /metrics listens on (default: 127.0.0.1)",
    )
    add_auth_token_argument(parser)
    add_cluster_secret_argument(parser)
    parser.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the router's OpenAI-compatible HTTP API (/v1/chat/completions, ...); 0: none "
        "(default: 8000)",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: shared)")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="each worker splits the model over N ranks, each a process of its own, sharing "
        "the worker's threads (a Llama-3 or DeepSeek-V3 model whose heads divide by N); "
        "--prefill-tp and --decode-tp set one role's (default: 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="every worker: DeepSeek-V3's data-parallel attention over N ranks, each caching "
        "and attending its own requests (the ranks on one host's CPU). The router balances "
        "decode workers by their emptiest rank's room (default: 1)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="every worker: "
        + "a mixture of experts (DeepSeek-V3) split over the ranks: each holds a share of the "
        "routed experts whole, rather than every expert's share of channels",
    )
    parser.add_argument(
        "--prefill-tp",
        type=int,
        metavar="N",
        help="tensor-parallel ranks of each prefill worker (default: --tensor-parallel-size); "
        "it may differ from the decode workers': KV travels as whole heads",
    )
    parser.add_argument(
        "--decode-tp",
        type=int,
        metavar="N",
        help="tensor-parallel ranks of each decode (or co-located) worker (default: "
        "--tensor-parallel-size)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        help="KV cache bytes per worker (per rank with --tensor-parallel-size)",
    )
    parser.add_argument("--block-size", type=int, help="tokens per KV block")
    parser.add_argument(
        "--fp8-weights",
        choices=FP8_WEIGHTS,
        help="a block-FP8 checkpoint's projections on every worker: dequantized once at load "
        "time or kept FP8 (half of bf16's weight bytes; W8A8 Triton products on the GPU path, "
        "0.35-0.55x bf16's speed on CPU). The workers' default, auto, keeps them where the "
        "Triton kernels run",
    )
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="workers run eagerly, without torch.compile. By default decode workers compile "
        "their decode steps before the cluster reports SERVING: about 1.8x the tokens per "
        "second at batch 1 on CPU, for minutes at the first start (less once the compile "
        "cache is warm); prefill workers run prefill eagerly either way",
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="accepted for old command lines and changes nothing: compiling is the default "
        "(--eager turns it off)",
    )
    parser.add_argument(
        "--transfer-stall-s",
        type=float,
        help="workers abort a KV push in which nothing moves for this long; the router "
        "prefills the request again (default: the workers', 10)",
    )
    parser.add_argument("--log-dir", help="write each process's log there (default: stderr)")
    parser.add_argument("--grace-s", type=float, default=30.0, help="drain time on shutdown")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one dead worker allowed within --restart-window-s; one more death "
        "stops the cluster (0: the first death stops it; default 5)",
    )
    parser.add_argument(
        "--restart-window-s",
        type=float,
        default=60.0,
        help="the window --max-restarts counts in (default 60)",
    )
    parser.set_defaults(func=_serve)


def role_tensor_parallel_sizes(args: argparse.Namespace) -> tuple[int, int, str]:
    """(prefill, decode) workers' tensor-parallel sizes from ``--tensor-parallel-size``,
    ``--prefill-tp`` and ``--decode-tp``, and what is wrong with them ("" when nothing)."""
    prefill = args.tensor_parallel_size if args.prefill_tp is None else args.prefill_tp
    decode = args.tensor_parallel_size if args.decode_tp is None else args.decode_tp
    for flag, size in (("--prefill-tp", prefill), ("--decode-tp", decode)):
        if size < 1:
            return prefill, decode, f"{flag}: must be at least 1, got {size}"
    if args.colocate and args.prefill_tp is not None:
        why = (
            "--prefill-tp: not with --colocate (co-located workers take --decode-tp or "
            "--tensor-parallel-size)"
        )
        return prefill, decode, why
    return 1 if args.colocate else prefill, decode, ""  # co-located: no prefill workers


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.model_store import ModelNotFoundError, resolve_model
    from ledger.redis_connect import RedisConnectError, RedisSettings
    from serving.auth import AuthConfigError, cluster_secret_from_args, read_secret_file
    from serving.engine_setup import check_engine_arguments
    from serving.launcher import Cluster, ClusterError, ClusterSpec
    from serving.supervisor import RestartPolicy, Supervisor

    if args.transfer_stall_s is not None and not args.transfer_stall_s > 0:
        print(
            f"tandem serve: error: --transfer-stall-s: must be positive, got "
            f"{args.transfer_stall_s:g}",
            file=sys.stderr,
        )
        return 2
    try:
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
    except ValueError as e:
        print(f"tandem serve: error: --max-restarts, --restart-window-s: {e}", file=sys.stderr)
        return 2
    if not check_engine_arguments(args, "tandem serve"):
        return 2
    if args.colocate and args.prefill:
        print(
            "tandem serve: error: --prefill: not with --colocate (each co-located worker "
            "prefills its own requests)",
            file=sys.stderr,
        )
        return 2
    prefill_tp, decode_tp, why = role_tensor_parallel_sizes(args)
    if why:
        print(f"tandem serve: error: {why}", file=sys.stderr)
        return 2
    num_prefill = 0 if args.colocate else (1 if args.prefill is None else args.prefill)
    try:
        model = str(resolve_model(args.model, tokenizer=args.tokenizer))
        redis_settings = RedisSettings.from_args(args) if args.redis_url else None
        stray = args.redis_username or args.redis_ca_file or args.redis_cert_file
        if not args.redis_url and stray:
            raise RedisConnectError("--redis-* options: need --redis-url (not the embedded Redis)")
        embedded_password = None  # the embedded Redis's: given, else random with auth on
        if not args.redis_url and args.redis_password_file:
            embedded_password = read_secret_file(args.redis_password_file, "--redis-password-file")
        if args.auth_token_file:  # fail here, once, rather than in the router
            read_secret_file(args.auth_token_file, "--auth-token-file")
        cluster_secret = cluster_secret_from_args(args)
    except (ModelNotFoundError, RedisConnectError, AuthConfigError) as e:
        print(f"tandem serve: error: {e}", file=sys.stderr)
        return 2
    worker_args = ["--dtype", args.dtype]
    for option, value in (
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--block-size", args.block_size),
        ("--max-model-len", args.max_model_len),
        ("--transfer-stall-s", args.transfer_stall_s),
        ("--fp8-weights", args.fp8_weights),
    ):
        if value is not None:
            worker_args += [option, str(value)]
    if args.enable_expert_parallel:
        worker_args.append("--enable-expert-parallel")
    if args.data_parallel_size != 1:  # the workers refuse a size below 1, naming the flag
        worker_args += ["--data-parallel-size", str(args.data_parallel_size)]
    worker_args += lora_flags(args)
    router_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    if args.allow_runtime_lora:
        router_args.append("--allow-runtime-lora")
    if args.served_model_name:
        worker_args += ["--served-model-name", args.served_model_name]
        router_args += ["--served-model-name", args.served_model_name]
    spec = ClusterSpec(
        model=model,
        draft=args.draft,
        draft_method=args.draft_method,
        suffix_cache_tokens=args.suffix_cache_tokens,
        num_draft_tokens=args.num_draft_tokens,
        adaptive_speculation=args.adaptive_speculation,
        num_prefill=num_prefill,
        num_decode=args.decode,
        colocate=args.colocate,
        redis=redis_settings,
        host=args.host,
        port=args.port,
        worker_host=args.worker_host,
        metrics_host=args.metrics_host,
        auth_token_file=Path(args.auth_token_file).resolve() if args.auth_token_file else None,
        cluster_secret=cluster_secret,
        redis_password=embedded_password,
        http_port=args.http_port,
        threads=args.threads,
        worker_args=tuple(worker_args),
        prefill_args=("--tensor-parallel-size", str(prefill_tp)) if prefill_tp > 1 else (),
        decode_args=("--tensor-parallel-size", str(decode_tp)) if decode_tp > 1 else (),
        eager=args.eager,
        router_args=tuple(router_args),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        grace_s=args.grace_s,
    )
    for line in exposure_warnings(spec):
        print(line, file=sys.stderr, flush=True)
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
    workers = f"{spec.num_prefill} prefill + {spec.num_decode} decode workers"
    if spec.colocate:
        workers = f"{spec.num_decode} co-located workers (prefill and decode)"
    print(
        f"tandem serve: router at {cluster.router_address}, {workers}, redis "
        f"{cluster.redis_url}; Ctrl-C stops",
        file=sys.stderr,
    )
    if cluster.router is not None and cluster.router.base_url:
        print(f"tandem serve: OpenAI API at {cluster.router.base_url}", file=sys.stderr)
    for component in cluster.components:
        print(f"tandem serve: {component.name} metrics {component.metrics_url}", file=sys.stderr)
    try:
        rc = Supervisor(cluster, policy).run(stop)
    finally:
        print("tandem serve: draining and stopping", file=sys.stderr)
        cluster.stop()
    return rc


def exposure_warnings(spec: ClusterSpec) -> list[str]:
    """A line for the router and one for the workers where they listen beyond loopback
    without authentication (the options that would add it)."""
    from serving.auth import exposure_warning

    found = [
        exposure_warning(
            "the router",
            spec.host,
            spec.port or "*",
            is_authenticated=spec.auth_token_file is not None,
            options="--auth-token-file PATH",
        ),
        exposure_warning(
            "the workers",
            spec.worker_host,
            "*",
            is_authenticated=spec.is_auth_on,
            options="--auth-token-file PATH (or --cluster-secret-file PATH)",
        ),
    ]
    return [line for line in found if line is not None]
