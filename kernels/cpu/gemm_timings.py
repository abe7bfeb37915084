"""Times the products of ``gemm_plan`` per weight shape and row bucket, once per machine.

Timings are cached in a JSON file per machine key (``machine_key``: the CPU's flags from
``/proc/cpuinfo``, torch's version, the thread count, and the variables that cap the ISAs
oneDNN, aten and the kernel use), under ``$TANDEM_CACHE/gemm``, else
``~/.cache/tandem/gemm``. The CPU's name never decides. A shape not in the file is timed
when a model first needs it (``plans``): each product at each bucket, interleaved, the
best of a few single calls, cache-hot; a shape's buckets stop where its time allowance
runs out (the larger buckets keep the last timed choice), and weights wider than
``MAX_TIMED_N`` are timed at that width, since every product's cost grows linearly past
it. SmolLM2-135M's five shapes take about a second.

    python -m kernels.cpu.gemm_timings          # SmolLM2-135M's shapes: timings and plans
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch

from kernels.cpu import bf16_gemm, extension, onednn_linear
from kernels.cpu.gemm_plan import ATEN, BUCKETS, KERNEL, ONEDNN, GemmPlan, choose, run_product

logger = logging.getLogger(__name__)

VERSION = 1  # of the file's layout and of how timings are taken
# Variables that change the timings: which instructions the products use (a cap
# re-measures), and how OpenMP's threads wait between parallel regions.
TIMING_ENV = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    bf16_gemm.DOT_ENV,
    extension.DISABLE_ENV,
    "OMP_WAIT_POLICY",
)
MAX_TIMED_N = 8192  # output features timed; wider weights (LM heads) cost proportionally
SHAPE_BUDGET_S = 0.25  # a shape's buckets are timed until this much time has gone
BUCKET_BUDGET_S = 0.01  # rounds at one bucket after MIN_ROUNDS, until this much has gone
MIN_ROUNDS, MAX_ROUNDS = 3, 20
# A parallel region of a few us that takes longer than this: other processes hold the
# cores, and every timing is a scheduler's time slice (4-8 ms measured here) instead.
BUSY_MS = 0.5
# While it times, the process keeps at least one thread running: CPU time under this
# share of the wall time means it waited for a core (one thread cannot show it above).
MIN_CPU_SHARE = 0.8
MIN_CHECKED_S = 0.05  # timings shorter than this are too short to judge the share by

Shape = tuple[int, int, torch.dtype]  # (out_features, in_features, weight dtype)
Timings = dict[int, dict[str, float]]  # bucket -> product -> us
Measure = Callable[[int, int, torch.dtype, Sequence[str]], Timings]


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The products that can run a ``dtype`` weight here."""
    products = [ATEN]
    if dtype == torch.bfloat16 and bf16_gemm.available():
        products.insert(0, KERNEL)
    if onednn_linear.available():
        products.append(ONEDNN)
    return tuple(products)


def cpu_flags() -> list[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(set(line.partition(":")[2].split()))
    return []


def machine_key() -> dict[str, object]:
    """What decides the timings, and nothing else (not the CPU's name)."""
    return {
        "version": VERSION,
        "machine": platform.machine(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in TIMING_ENV},
        "kernels": extension.KERNELS.stamp()[:16],  # a rebuilt kernel is timed again
    }


def default_cache_dir() -> Path:
    """``$TANDEM_CACHE/gemm``, else ``~/.cache/tandem/gemm`` (engine.model_store's root)."""
    root = os.environ.get("TANDEM_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "tandem") / "gemm"


def cache_path(key: dict[str, object], cache_dir: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{digest}.json"


def timed_shape(shape: Shape) -> str:
    n, k, dtype = shape
    return f"{str(dtype).removeprefix('torch.')} {min(n, MAX_TIMED_N)}x{k}"


def default_plan(products: Sequence[str]) -> GemmPlan:
    """Without timings: the kernel where it runs the weight, else oneDNN from 2 rows."""
    if KERNEL in products:
        return GemmPlan.uniform(KERNEL)
    if ONEDNN in products:
        return GemmPlan((ATEN,) + (ONEDNN,) * (len(BUCKETS) - 1))
    return GemmPlan.uniform(ATEN)


def parallel_region_ms() -> float:
    """The best of 10 short parallel regions (a fill split over the threads): about 0.01
    ms where every thread has a core."""
    x, best = torch.empty(1 << 16), math.inf
    for _ in range(10):
        t0 = time.perf_counter()
        x.fill_(1.0)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def is_busy() -> bool:
    return torch.get_num_threads() > 1 and parallel_region_ms() > BUSY_MS


def waited_for_a_core(wall_s: float, cpu_s: float) -> bool:
    """Whether a timing run of ``wall_s`` got less than MIN_CPU_SHARE of it as CPU time:
    other processes held the cores (a one-thread engine's only sign of it)."""
    return wall_s >= MIN_CHECKED_S and cpu_s < MIN_CPU_SHARE * wall_s


def measure(n: int, k: int, dtype: torch.dtype, products: Sequence[str]) -> Timings:
    """Each product's best single call, in us, at each bucket's rows, until the shape's
    allowance is spent."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=g).div(math.sqrt(k)).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    panels = bf16_gemm.pack(weight) if KERNEL in products else None
    onednn = onednn_linear.pack(weight, bias) if ONEDNN in products else None
    products = [p for p in products if p != ONEDNN or onednn is not None]
    timings: Timings = {}
    start = time.perf_counter()
    with torch.inference_mode():
        for rows in BUCKETS:
            if timings and time.perf_counter() - start > SHAPE_BUDGET_S:
                break
            x = torch.randn(rows, k, generator=g).to(dtype)
            calls = {p: (p, x, weight, bias, panels, onednn, n) for p in products}
            for args in calls.values():
                run_product(*args)  # warm-up
            best = dict.fromkeys(calls, math.inf)
            bucket_start = time.perf_counter()
            for round_ in range(MAX_ROUNDS):
                for product, args in calls.items():
                    t0 = time.perf_counter()
                    run_product(*args)
                    best[product] = min(best[product], time.perf_counter() - t0)
                if (
                    round_ + 1 >= MIN_ROUNDS
                    and time.perf_counter() - bucket_start > BUCKET_BUDGET_S
                ):
                    break
            timings[rows] = {p: round(t * 1e6, 2) for p, t in best.items()}
    return timings


def plans(
    shapes: Iterable[Shape], *, cache_dir: Path | None = None, timer: Measure | None = None
) -> dict[Shape, GemmPlan]:
    """The plan of each shape, from this machine's cached timings; shapes not cached yet
    (or cached without one of today's candidates) are timed now, by ``timer`` (default
    ``measure``), and added to the file."""
    key = machine_key()
    path = cache_path(key, cache_dir or default_cache_dir())
    shapes = sorted(set(shapes), key=str)
    with _locked(path):
        entries = _load(path, key)
        missing = {  # by the name they are timed under: wide weights share one
            timed_shape(shape): shape
            for shape in shapes
            if not set(candidates(shape[2]))
            <= set(entries.get(timed_shape(shape), {}).get(BUCKETS[0], {}))
        }
        started, cpu_started, timed = time.perf_counter(), time.process_time(), {}
        if missing and not is_busy():
            for name, (n, k, dtype) in missing.items():
                timed[name] = (timer or measure)(min(n, MAX_TIMED_N), k, dtype, candidates(dtype))
            if waited_for_a_core(time.perf_counter() - started, time.process_time() - cpu_started):
                timed = {}
        if missing and (not timed or is_busy()):
            logger.warning(
                "this machine is too busy to time products (other processes hold the cores: "
                "a short parallel region took %.1f ms); %d weight shape(s) run on the default "
                "products until an engine starts on a quieter machine",
                parallel_region_ms(),
                len(missing),
            )
        elif timed:
            entries.update(timed)
            _store(path, key, entries)
            logger.info(
                "timed the products of %d weight shape(s) in %.2f s; cached in %s",
                len(timed),
                time.perf_counter() - started,
                path,
            )
    chosen = {
        shape: choose(entries[timed_shape(shape)], candidates(shape[2]))
        if timed_shape(shape) in entries
        else default_plan(candidates(shape[2]))
        for shape in shapes
    }
    for shape, plan in chosen.items():
        logger.info("products for %s: %s", timed_shape(shape), plan.describe())
    return chosen


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process times at a time (workers starting together would slow each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(path: Path, key: dict[str, object]) -> dict[str, Timings]:
    """The file's timings by shape; none if it is missing, for another key, or unreadable
    (a warning: it is timed again and rewritten)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the product timings in %s (%s); timing again", path, exc)
        return {}
    try:
        entries = {
            name: {
                int(rows): {str(p): float(t) for p, t in times.items()}
                for rows, times in per_rows.items()
            }
            for name, per_rows in data["timings_us"].items()
        }
        file_key = data["key"]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("ignoring the product timings in %s (%r); timing again", path, exc)
        return {}
    return entries if file_key == key else {}  # another key of the same hash: not ours


def _store(path: Path, key: dict[str, object], entries: dict[str, Timings]) -> None:
    """Written whole and renamed into place: readers never see half a file."""
    data = {
        "key": key,
        "timings_us": {name: {str(r): t for r, t in e.items()} for name, e in entries.items()},
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


# SmolLM2-135M's products (out, in): qkv, o, gate_up, down, the LM head
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _main() -> None:
    """Times the products at SmolLM2-135M's shapes (not cached); prints each shape's
    timings and plan, then one JSON line of them all."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    products = candidates(dtype)
    result: dict[str, object] = {
        "key": {k: v for k, v in machine_key().items() if k != "cpu_flags"},
        "avx512_bf16": "avx512_bf16" in cpu_flags(),
        "amx_bf16": "amx_bf16" in cpu_flags(),
        "kernel_bf16_dot": bf16_gemm.dot_supported(),
        "onednn_dtype": str(onednn_linear.layout_dtype(dtype)).removeprefix("torch."),
        # about 0.01 ms where every thread has a core; past BUSY_MS engines would not time
        "parallel_region_ms": round(parallel_region_ms(), 3),
        "shapes": {},
    }
    started = time.perf_counter()
    for n, k in SMOLLM2_SHAPES:
        timings = measure(min(n, MAX_TIMED_N), k, dtype, products)
        plan = choose(timings, products)
        name = timed_shape((n, k, dtype))
        print(f"{name}: {plan.describe()}")
        print(f"{'rows':>5} " + " ".join(f"{p:>9}" for p in products) + "  (us)")
        for rows, times in timings.items():
            print(f"{rows:>5} " + " ".join(f"{times[p]:>9.1f}" for p in products))
        shapes = result["shapes"]
        assert isinstance(shapes, dict)
        shapes[name] = {"plan": plan.describe(), "products": plan.products, "timings_us": timings}
    result["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
