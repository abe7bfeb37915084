"""The committed generated package `client/tandem/` is exactly what scripts/gen_protos produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _files(tmp_path / "tandem")
    committed = _files(REPO / "client" / "tandem")
    stale = sorted(
        name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name)
    )
    assert not stale, (
        f"client/tandem/ is out of date with protos/ ({', '.join(stale)} differ): "
        "run scripts/gen_protos"
    )


def test_generated_stubs_import() -> None:
    """The grpc modules resolve their `from tandem.v1 import ...` imports."""
    from tandem.v1 import generation_pb2_grpc, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

    assert generation_pb2_grpc.GenerationStub
    assert kv_transfer_pb2_grpc.KvTransferStub
    assert worker_pb2_grpc.DecodeWorkerStub and worker_pb2_grpc.PrefillWorkerStub
    reply = worker_pb2.ReserveReply(block_ids=[3, 4, 5], epoch=2**60)
    assert worker_pb2.ReserveReply.FromString(reply.SerializeToString()) == reply
