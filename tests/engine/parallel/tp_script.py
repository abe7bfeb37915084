"""A tensor-parallel engine in a process of its own, for the tests of how its ranks end:
``python -m tests.engine.parallel.tp_script MODEL_DIR MODE``. It prints ``ranks <pids>``
once the engine is up, then, by MODE:

- ``exit``: generates, prints ``done``, and exits without closing the engine;
- ``wait``: waits to be killed;
- ``kill-rank``: SIGKILLs rank 1, steps, and when a step raises, closes the engine and
  prints ``failed <seconds> <message>``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams


def main() -> None:
    model_dir, mode = sys.argv[1], sys.argv[2]
    config = EngineConfig(
        model=model_dir,
        dtype="float32",
        block_size=4,
        kv_cache_memory=8 << 20,
        num_threads=2,
        tensor_parallel_size=2,
    )
    engine = LLMEngine(config)
    pids = [p.pid for p in engine.runner.executor.ranks.processes]  # type: ignore[attr-defined]
    print("ranks", *pids, flush=True)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], params)
    if mode == "exit":
        while engine.has_unfinished_requests():
            engine.step()
        print("done", flush=True)
        return
    if mode == "wait":
        engine.step()
        print("waiting", flush=True)
        time.sleep(600)
        return
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    started = time.monotonic()
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except RuntimeError as e:
        waited = time.monotonic() - started
        engine.close()  # with a rank gone: must not hang
        print("failed", f"{waited:.2f}", str(e).replace("\n", " "), flush=True)
        return
    print("not failed", flush=True)


if __name__ == "__main__":
    main()
