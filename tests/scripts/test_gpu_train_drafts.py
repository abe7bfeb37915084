"""scripts/gpu_train_drafts, the prepared draft training for a lent GPU (issue 42), on CPU:
its dry run goes through every phase (the real GGUF split in two and joined again, data
from a tiny random target, EAGLE-3, EAGLE and DFlash drafts, their pieces), within the
files a GPU run brings back, and the drafts joined from the pieces load; its help says
how to run it; the pieces leave out the drafts trained last where they would be too many."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.scripts.script_module import load_script as load_script_at

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_train_drafts"


def load_script() -> ModuleType:
    return load_script_at(SCRIPT)


def test_the_dry_run_goes_through_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "gpu_train_drafts.json").read_text())
    assert set(summary["phases"]) == {"target", "data", "eagle3", "eagle", "dflash", "join"}
    assert summary["phases"]["data"]["sequences"] == 40
    from engine.model_store import source_gguf

    script = load_script()
    assert summary["phases"]["target"]["gguf_sha256"] == script.sha256(source_gguf("smollm2"))
    # A quarter of the prompts continued past EOS (all 8 tokens), the held-out sets apart.
    assert summary["phases"]["data"]["heldout_sets"] == {"chat": 4, "code": 4}
    assert summary["phases"]["data"]["generated_tokens"] >= 10 * 8
    for kind in ("eagle3", "eagle", "dflash"):
        assert summary["drafts"][kind]["steps"] > 0
        assert summary["drafts"][kind]["heldout_tau"] >= 1.0
        assert set(summary["drafts"][kind]["decoding_tau_on"]) == {"chat", "code"}
        assert all(t >= 1.0 for t in summary["drafts"][kind]["decoding_tau_on"].values())
    assert summary["draft_vocab"]["covers"] >= 0.97
    files = sorted(p.name for p in out.iterdir())
    assert files == ["drafts.tar.000", "gpu_train_drafts.json", "train.log"]
    assert all((out / f).stat().st_size < 16 << 20 for f in files)
    assert "eagle3: " in (out / "train.log").read_text()
    # The drafts, joined from their pieces as after a GPU run, load beside their target.
    from engine.registry import load_model
    from engine.spec.drafters import load_drafter

    work = out.parent / ".out-work"
    target, _ = load_model(str(work / "target"), dtype="float32", device=torch.device("cpu"))
    joined = tmp_path / "joined"
    assert script.join_drafts(out, joined) == ["dflash", "eagle", "eagle3"]
    for kind in ("eagle3", "eagle", "dflash"):
        manifest = json.loads((joined / kind / "manifest.json").read_text())
        assert manifest["kind"] == kind and manifest["command"].startswith("scripts/gpu_train")
        assert manifest["data"]["generator"] == "transformers generate, greedy, on cpu"
        assert load_drafter(joined / kind, target, torch.device("cpu")).kind == kind


def test_the_staged_parts_join_to_the_file_and_a_changed_part_is_refused(tmp_path: Path) -> None:
    script = load_script()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 1000)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(script, "FIRST_PART_BYTES", 100_000)
    try:
        first, second = script.stage(gguf, tmp_path / "a")
    finally:
        monkey.undo()
    assert first.stat().st_size == 100_000 and second.stat().st_size == 156_000
    # The parts may lie in different folders (call 1's copy, call 2's tree).
    (tmp_path / "b").mkdir()
    second.rename(tmp_path / "b" / second.name)
    joined = script.join_parts((tmp_path / "a", tmp_path / "b"), tmp_path / "joined.gguf")
    assert joined.read_bytes() == gguf.read_bytes()
    (tmp_path / "b" / second.name).write_bytes(b"\0" * 156_000)
    with pytest.raises(SystemExit, match="sha256"):
        script.join_parts((tmp_path / "a", tmp_path / "b"), tmp_path / "joined.gguf")


def test_the_staged_prompts_begin_with_the_targets_own_messages_and_skip_held_out(
    tmp_path: Path,
) -> None:
    import gzip

    from training.corpus import load_heldout

    script = load_script()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 10)
    script.stage(gguf, tmp_path / "s", num_prompts=300)
    with gzip.open(tmp_path / "s" / script.PROMPTS, "rt") as f:
        texts = json.load(f)
    messages = script.self_instruct_texts()
    assert len(messages) == 7000  # openers-seed2 and -seed3
    assert len(texts) == 300 and len(set(texts)) == 300
    assert texts[:150] == messages[:150]  # half of them, the rest from the corpus
    assert not set(texts) & {*load_heldout("chat"), *load_heldout("code")}


def test_the_pieces_leave_out_the_drafts_trained_last_where_too_many(tmp_path: Path) -> None:
    script = load_script()
    drafts = {}
    for kind, size in (("eagle3", 20), ("eagle", 8), ("dflash", 9)):
        drafts[kind] = tmp_path / kind
        drafts[kind].mkdir()
        noise = torch.randint(0, 255, (size << 20,), dtype=torch.uint8)
        (drafts[kind] / "model.safetensors").write_bytes(noise.numpy().tobytes())
    out = tmp_path / "out"
    out.mkdir()
    pieces = script.pack(drafts, out, 2, tmp_path)  # 30 MiB: eagle3 and eagle, not dflash
    assert [p.name for p in pieces] == ["drafts.tar.000", "drafts.tar.001"]
    assert script.join_drafts(out, tmp_path / "joined") == ["eagle", "eagle3"]
    assert (tmp_path / "joined" / "eagle" / "model.safetensors").read_bytes() == (
        drafts["eagle"] / "model.safetensors"
    ).read_bytes()


def test_help_says_how_to_stage_run_and_join() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    for said in ("--stage", 'carry [".gpu_stage/smollm2.gguf.0"]', "--join FILES_AT"):
        assert said in done.stdout


def test_joining_refuses_pieces_of_anything_but_drafts(tmp_path: Path) -> None:
    import tarfile

    script = load_script()
    (tmp_path / "x").write_text("x")
    with tarfile.open(tmp_path / "drafts.tar.000", "w") as tar:
        tar.add(tmp_path / "x", arcname="../x")
    keep = tmp_path / "into" / "eagle3"
    keep.mkdir(parents=True)
    with pytest.raises(SystemExit, match="no draft"):
        script.join_drafts(tmp_path, tmp_path / "into")
    assert keep.is_dir() and not (tmp_path / "into" / ".drafts.tar").exists()


def test_each_draft_gets_its_turn_when_the_ones_before_overrun() -> None:
    """On the GPU's budget: each training runs its time plus its overhead and 10 s more;
    the time left is shared again before each, so DFlash still trains."""
    script = load_script()
    remaining, got = 360.0, {}
    kinds = list(script.TRAIN_SHARES)
    for i, kind in enumerate(kinds):
        seconds = script.train_seconds(remaining, kinds[i:], "gpu")
        assert seconds is not None, (kind, remaining)
        got[kind] = seconds
        remaining -= seconds + script.OVERHEAD_S["gpu"] + 10
    assert got["eagle3"] == max(got.values()) and min(got.values()) > script.MIN_TRAIN_S["gpu"]
    assert script.train_seconds(55.0, ["dflash"], "gpu") is None  # 15 s after its overhead
