"""The servers ``bench/serving.py`` runs side by side: llama.cpp's ``llama-server`` and a
Tandem cluster (``serving.launcher.Cluster``), each a context manager that yields once the
server answers and stops it after."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CTX_PER_SLOT = 1024  # a built-in chat (< 100 tokens with the template) + 128 new tokens
KV_CACHE_MEMORY = 512 << 20  # Tandem's per worker: 512 MiB holds 32 such requests


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(
    binary: Path, gguf: Path, slots: int, threads: int, log_dir: Path
) -> Iterator[str]:
    """A running llama-server's base URL. Where its default weight repacking crashes it at
    start (its AMX path with a Q4_1 file, on the Sapphire Rapids VM of 2026-11-30: SIGSEGV),
    it is started again with ``--no-repack``, which ``NO_REPACK`` then lists."""
    try:
        with _llama_server(binary, gguf, slots, threads, log_dir, []) as url:
            yield url
            return
    except LlamaCrashedError:
        print(f"[serving] llama-server crashed on {gguf.name}: --no-repack", file=sys.stderr)
    NO_REPACK.add(gguf.name)
    with _llama_server(binary, gguf, slots, threads, log_dir, ["--no-repack"]) as url:
        yield url


NO_REPACK: set[str] = set()  # the GGUF files llama-server ran with --no-repack


class LlamaCrashedError(RuntimeError):
    """llama-server died of a signal before it was healthy."""


@contextmanager
def _llama_server(
    binary: Path, gguf: Path, slots: int, threads: int, log_dir: Path, flags: list[str]
) -> Iterator[str]:
    port = free_port()
    command = [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads),
        "-np", str(slots), "-cb", "--ctx-size", str(slots * CTX_PER_SLOT),
        "-a", "smollm2", "--no-webui", *flags,
    ]  # fmt: skip
    log_path = log_dir / f"llama-server-{gguf.stem}-np{slots}{''.join(flags)}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                if process.returncode < 0 and not flags:
                    raise LlamaCrashedError(f"llama-server died of signal {-process.returncode}")
                raise RuntimeError(f"llama-server exited with {process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after 120 s; log: {log_path}")
            time.sleep(0.5)
        print(f"[serving] {' '.join(command)}", file=sys.stderr, flush=True)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def tandem_cluster(
    side: str,
    model_dir: Path,
    draft: Path | None,
    threads: int | None,
    compile_: bool,
    colocate: bool,
    log_dir: Path,
) -> Iterator[tuple[str, str, str]]:
    """A running Tandem cluster: (its OpenAI base URL, its processes and threads, its decode
    worker's /metrics URL or "")."""
    from serving.launcher import Cluster, ClusterSpec

    spec = ClusterSpec(
        model=str(model_dir),
        draft=str(draft) if draft is not None else None,
        draft_method="suffix" if side.endswith("suffix") else None,
        # Each prompt comes back in every pair and level (the datasets have 64 and 79):
        # outputs kept across requests would draft the very answers again.
        suffix_cache_tokens=0 if side.endswith("suffix") else None,
        num_prefill=0 if colocate else 1,
        colocate=colocate,
        port=0,
        threads=threads,
        worker_args=("--dtype", "bfloat16", "--kv-cache-memory", str(KV_CACHE_MEMORY)),
        eager=not compile_,
        service_args=("--log-level", "WARNING"),
        log_dir=log_dir / side,
        # Speculative sides: the decode worker's counters and K histogram around each run.
        is_metrics_served=bool(draft) or side.endswith("suffix"),
    )
    workers = "1 co-located worker" if colocate else "1 prefill, 1 decode worker"
    shape = (
        f"router (1 thread), {workers}: {spec.threads_per_process()} torch thread(s) each on "
        f"{cores()} cores" + (", decode compiled" if compile_ else "")
    )
    with Cluster(spec) as cluster:
        assert cluster.router is not None
        yield cluster.router.base_url, shape, cluster.decode[0].metrics_url
