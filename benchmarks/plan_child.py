"""Benchmark 8's child: the measured peak memory of each stage of a prepared run, in a fresh
interpreter, against `flowgrpo plan`'s prediction, printed as one JSON line.

    python -m benchmarks.plan_child RUN_DIR

Memory is the resident set (VmRSS / VmHWM of /proc/self/status) above a baseline taken after
every import and before the model loads. glibc is told to serve allocations above 64 kB with
mmap (MALLOC_MMAP_THRESHOLD_, set by the parent), so freed tensors leave the resident set and
it follows the live bytes, as a GPU allocator's counter would. Each stage's peak is VmHWM
after resetting it at the stage's start (`/proc/self/clear_refs`), sampled as well every
millisecond. Stages: iteration 0's rollout, score and update (AdamW's moments appear at the
update's first optimizer step), then iteration 1's rollout (with the moments resident).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(run_root: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch

    from benchmarks.memory_child import PeakSampler, _reset_peak, _status
    from flowgrpo_cli.engines import build_engine
    from flowgrpo_cli.planning import plan_run
    from flowgrpo_cli.rewards.commands import build_rewards_from_config
    from flowgrpo_cli.stages import rollout, score, update
    from flowgrpo_cli.store.config import load_config
    from flowgrpo_cli.store.rundir import RunDir
    from flowgrpo_cli.training.policy import load_policy
    from flowgrpo_cli.training.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run = RunDir(Path(run_root))
    config = load_config(run.config_path)
    plan = plan_run(config, iterations=2)  # before the baseline: its meta modules stay
    import gc

    gc.collect()
    baseline = _status()["VmRSS"]
    policy = load_policy(config, torch.device("cpu"))
    trainer = Trainer(config, policy)
    engine = build_engine(config, policy)
    measured: dict[str, int] = {}

    def measure(name: str, fn) -> None:
        started = time.perf_counter()
        gc.collect()
        if not _reset_peak():
            raise RuntimeError("/proc/self/clear_refs refused: cannot measure a stage's peak")
        sampler = PeakSampler()
        sampler.start()
        fn()
        peak = max(sampler.stop().get("VmRSS", 0), _status()["VmHWM"])
        measured[name] = max(measured.get(name, 0), peak - baseline)
        print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    with build_rewards_from_config(config.reward) as rewards:
        measure("rollout", lambda: rollout.run(config, run, 0, engine))
        measure("score", lambda: score.run(config, run, 0, rewards))
        measure("update", lambda: update.run(config, run, 0, trainer))
        measure("rollout", lambda: rollout.run(config, run, 1, engine))
    print(
        json.dumps(
            {
                "baseline": baseline,
                "measured": measured,
                "predicted": {stage: m.total_bytes for stage, m in plan.memory.items()},
                "items": {stage: m.items for stage, m in plan.memory.items()},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
