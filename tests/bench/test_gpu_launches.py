"""``bench/gpu_launches.py`` counts the kernels a unified step launches on the GPU path
(on CPU, through Triton's interpreter). The counts are exact: a change that adds a launch
to every layer, or to every step, fails here and says so (on a GPU each launch in a
captured step costs a few microseconds; ``bench/RESULTS.md``, the GPU check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_plain_step_launches_eleven_kernels_a_layer_and_49_apart() -> None:
    done = subprocess.run(
        [sys.executable, "bench/gpu_launches.py", "--k", "0", "--layers", "8", "9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads(done.stdout.strip().splitlines()[-1])["steps"]["k0"]
    # Per layer: 2 norms (residual adds fused), 4 products, rotary, the K/V write, attention
    # split over the context (512 positions, planned for 132 SMs) and its combine, and the
    # activation.
    assert plain["per_layer"] == 11, plain["by_name"]
    # Once a step: the inputs staged, the layout, the embedding, the final norm and LM head,
    # acceptance and the outputs.
    assert plain["apart_from_layers"] == 49, plain["by_name"]
    assert plain["by_name"]["triton:_store_kernel"] == 9  # K and V in one launch a layer
    assert plain["by_name"]["triton:_combine_kernel"] == 9
