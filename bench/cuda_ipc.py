"""CUDA IPC against a device copy (issue 41): the bytes of one KV push copied from this
process into another process's pool through CUDA IPC (``kv_transfer.cuda_ipc``), against a
device-to-device copy of the same bytes within this process.

A spawned receiver allocates a pool of ``--mib`` MiB on the GPU, exports it, and sends the
handle over a pipe as bytes. This process opens it and copies a random source into it in
runs of ``--run-mib`` MiB (one layer's K or V of a 2,048-token prompt of Llama-3-8B is 4
MiB: 2048 positions x 8 KV heads x 128 x 2 bytes), timed with device synchronization,
``--repeats`` times. Then the receiver checksums what it holds on its device and sends
that back: it must equal the source's. The local copy writes the same runs into a tensor of
this process. What is compared is the copy alone: the handle's opening is timed apart, as
a receiver's pools are opened once per sender and kept (``shm_channel``'s cache does so
for shared memory).

    python bench/cuda_ipc.py              # on a GPU: 256 MiB in 4 MiB runs
    python bench/cuda_ipc.py --mib 64     # smaller

Without CUDA it says so and exits 2. The last line is one JSON object with
``cuda_ipc_over_d2d``: the IPC copy's bandwidth over the local copy's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import struct
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_transfer.cuda_ipc import IpcHandle, OpenedTensor, export, unavailable_reason

_DIGEST = struct.Struct("<q")
WAIT_S = 120.0  # for the receiver's next message (its start, the pool, the checksum)


def digest(data: torch.Tensor) -> int:
    """A position-weighted checksum of a uint8 CUDA tensor (a multiple of 4 KiB), computed
    on its device: a block written in the wrong place changes it."""
    rows = data.view(torch.int32).view(-1, 1024).sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, rows.numel() + 1, device=data.device, dtype=torch.int64)
    return int((rows * weights).sum())


def receive(conn: Connection, num_bytes: int) -> None:
    """The receiver process: a pool, its handle sent, then its checksum once written. If it
    fails, its end of the pipe closes and the sender's wait ends."""
    pool = torch.zeros(num_bytes, dtype=torch.uint8, device="cuda")
    conn.send_bytes(export(pool).to_bytes())
    conn.recv_bytes()  # the sender wrote and synchronized
    torch.cuda.synchronize()
    conn.send_bytes(_DIGEST.pack(digest(pool)))
    conn.recv_bytes()  # the sender closed its mapping: the pool may go


def next_message(conn: Connection, receiver: Any, what: str, wait_s: float = WAIT_S) -> bytes:
    """The receiver's next message; raises at once if it ended (its end of the pipe closed:
    only it holds that end), and after ``wait_s`` if it says nothing."""
    if not conn.poll(wait_s):
        raise TimeoutError(f"the receiver sent no {what} within {wait_s:.0f} s")
    try:
        return conn.recv_bytes()
    except EOFError:
        receiver.join(10)
        code = receiver.exitcode
        raise RuntimeError(f"the receiver ended (exit {code}) before its {what}") from None


def copy_runs(dst: torch.Tensor, src: torch.Tensor, run_bytes: int) -> float:
    """Seconds to copy ``src`` into ``dst`` run by run, synchronized before and after."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for start in range(0, src.numel(), run_bytes):
        dst[start : start + run_bytes].copy_(src[start : start + run_bytes])
    torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(num_bytes: int, run_bytes: int, repeats: int) -> dict[str, Any]:
    """Both copies' bandwidth (bytes written per second, median of ``repeats``), the open
    time, and whether the receiver holds exactly the source."""
    source = torch.randint(
        0, 256, (num_bytes,), dtype=torch.uint8, device="cuda",
        generator=torch.Generator("cuda").manual_seed(0),
    )  # fmt: skip
    local = torch.empty_like(source)
    spawn = multiprocessing.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    receiver = spawn.Process(target=receive, args=(child_conn, num_bytes), daemon=True)
    receiver.start()
    child_conn.close()  # only the receiver holds it now: its death ends our waits

    try:
        handle = IpcHandle.from_bytes(next_message(conn, receiver, "handle"))
        started = time.perf_counter()
        opened = OpenedTensor(handle)
        open_s = time.perf_counter() - started
        copy_runs(opened.bytes, source, run_bytes)  # warm-up
        copy_runs(local, source, run_bytes)
        ipc = sorted(copy_runs(opened.bytes, source, run_bytes) for _ in range(repeats))
        d2d = sorted(copy_runs(local, source, run_bytes) for _ in range(repeats))
        conn.send_bytes(b"written")
        (received,) = _DIGEST.unpack(next_message(conn, receiver, "checksum"))
        opened.close()
        conn.send_bytes(b"closed")
        receiver.join(timeout=60)
    finally:
        if receiver.is_alive():
            receiver.kill()
    ipc_s, d2d_s = ipc[len(ipc) // 2], d2d[len(d2d) // 2]
    return {
        "num_bytes": num_bytes,
        "run_bytes": run_bytes,
        "repeats": repeats,
        "open_ms": round(open_s * 1e3, 3),
        "ipc_gb_s": round(num_bytes / ipc_s / 1e9, 2),
        "d2d_gb_s": round(num_bytes / d2d_s / 1e9, 2),
        "cuda_ipc_over_d2d": round(d2d_s / ipc_s, 4),
        "received_equals_source": received == digest(source),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="bytes pushed, MiB")
    parser.add_argument("--run-mib", type=int, default=4, help="bytes per copied run, MiB")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"cuda_ipc: {reason}", file=sys.stderr)
        return 2
    if args.mib < 1 or args.run_mib < 1 or args.repeats < 1:
        parser.error("--mib, --run-mib and --repeats must be at least 1")
    result = {"device": torch.cuda.get_device_name(0)}
    result.update(measure(args.mib << 20, args.run_mib << 20, args.repeats))
    print(json.dumps(result))
    return 0 if result["received_equals_source"] else 1


if __name__ == "__main__":
    sys.exit(main())
