"""Kernel launches per unified step on the GPU path, counted on CPU (issue 41).

On a GPU, a captured step is a chain of kernels, and at batch 1 most of them are small: a
Llama-3-8B step's time apart from its weights' bytes is mostly their number times a few
microseconds each (``bench/RESULTS.md``, the GPU check). This counts that number without a
GPU: it builds ``bench/gpu_step.py``'s step (SmolLM2's shape, random weights) on the Triton
path, runs one step under Triton's interpreter, and counts every Triton launch and every
torch operator that would launch a kernel (not views, not a conversion that returns its
input, not an operator on an empty tensor), by name, and with ``--by-site`` by the line
of this repository that called it. Counting two depths (``--layers``) separates what each
layer launches from what the step launches once. The rows are at the GPU check's context
(512 positions), and attention splits it as it would on an H200's 132 SMs (a combining
kernel a layer where it splits).

    python bench/gpu_launches.py                    # K=0 and K=5, 8 and 12 layers
    python bench/gpu_launches.py --k 5 --by-site    # where a K=5 step's launches come from

The last line is one JSON object: launches per step by setting and depth, per layer and
per step apart from the layers, and the launches by name.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined: before any import
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import gpu_step  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kernels.triton import attention  # noqa: E402

VIEWS = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "split", "unbind",
         "split_with_sizes", "unsqueeze", "squeeze", "t", "transpose", "permute", "alias",
         "as_strided", "detach", "narrow", "_reshape_alias", "empty", "empty_like",
         "empty_strided", "new_empty", "lift_fresh", "sym_size", "is_same_size"}  # fmt: skip


class Launches(TorchDispatchMode):
    """Counts the operators that would launch a kernel, and Triton's launches, while on."""

    def __init__(self, by_site: bool) -> None:
        super().__init__()
        self.by_site, self.names, self.sites = by_site, collections.Counter(), collections.Counter()
        self._inside_triton = False
        self._run = interpreter.InterpretedFunction.run

    def __enter__(self) -> Launches:
        counter, run = self, self._run

        def counted_run(fn: Any, *args: Any, **kwargs: Any) -> Any:
            counter._count(f"triton:{fn.fn.__name__}")
            counter._inside_triton = True  # the interpreter's own torch calls are not launches
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter._inside_triton = False

        interpreter.InterpretedFunction.run = counted_run  # type: ignore[method-assign]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        interpreter.InterpretedFunction.run = self._run  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        first = args[0] if args else None
        returned_input = out is first and not name.endswith("_")  # in place: it wrote
        is_noop = returned_input or (isinstance(out, torch.Tensor) and out.numel() == 0)
        if not self._inside_triton and name not in VIEWS and not is_noop:
            self._count(f"aten:{name}")
        return out

    def _count(self, name: str) -> None:
        self.names[name] += 1
        if self.by_site:
            ours = [f for f in traceback.extract_stack()[:-3] if f.filename.startswith(str(ROOT))]
            ours = [f for f in ours if "site-packages" not in f.filename]  # a venv in ROOT
            ours = [f for f in ours if not f.filename.endswith("gpu_launches.py")]
            if ours:
                where = ours[-1]
                self.sites[f"{name} @ {Path(where.filename).relative_to(ROOT)}:{where.lineno}"] += 1


def count(layers: int, k: int, by_site: bool, context: int) -> Launches:
    """One step of ``bench/gpu_step.py``'s SmolLM2-shaped model cut to ``layers`` layers,
    its rows at a KV length of ``context``, attention split as on ``num_sms`` SMs."""
    gpu_step.SHAPES["smollm2"]["num_hidden_layers"] = layers
    gpu_step.select_backend = lambda device, block_size: "triton"  # type: ignore[assignment]
    gpu_step.kernels_for = lambda *_: "triton"  # type: ignore[assignment]
    args = argparse.Namespace(batches=[1], context=context, rates=[0.8, 0.7, 0.6, 0.5, 0.4],
                              profile=False, threads=2, quick=True)  # fmt: skip
    bench = gpu_step.StepBench("smollm2", torch.device("cpu"), args)
    inputs = bench.inputs(1, k)
    bench.runner(inputs, k, defer_drafter=k == 0)  # the first step sets up what it keeps
    with Launches(by_site) as launches:
        bench.runner(inputs, k, defer_drafter=k == 0)
    return launches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="*", default=[0, 5], help="drafts per step")
    parser.add_argument("--layers", type=int, nargs=2, default=[8, 12], help="two depths")
    parser.add_argument("--by-site", action="store_true", help="also count by calling line")
    parser.add_argument(
        "--context", type=int, default=512, help="KV length of the row (gpu_step.py's default)"
    )
    parser.add_argument(
        "--num-sms",
        type=int,
        default=132,
        help="plan attention's splits of the context for this many SMs (an H200's 132)",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    attention.num_sms = lambda device: args.num_sms  # type: ignore[assignment]
    result: dict[str, Any] = {"steps": {}}
    for k in args.k:
        totals = {}
        for layers in args.layers:
            launches = count(layers, k, args.by_site, args.context)
            totals[layers] = sum(launches.names.values())
            print(f"K={k}, {layers} layers: {totals[layers]} launches", file=sys.stderr)
            for name, n in launches.names.most_common():
                print(f"  {n:4d} {name}", file=sys.stderr)
            for site, n in launches.sites.most_common(40):
                print(f"  {n:4d} {site}", file=sys.stderr)
        shallow, deep = args.layers
        per_layer = (totals[deep] - totals[shallow]) / (deep - shallow)
        result["steps"][f"k{k}"] = {
            "launches": totals,
            "per_layer": per_layer,
            "apart_from_layers": totals[shallow] - per_layer * shallow,
            "by_name": dict(launches.names.most_common()),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
