"""Benchmark 3's child: one `flowgrpo update` of a prepared, rolled-out and scored run, in a
fresh interpreter, printing its memory as one JSON line.

    python -m benchmarks.memory_child RUN_DIR

Reports, in bytes:
- ru_maxrss: the process's peak resident set (interpreter, torch, the model and the update);
- before_*: VmRSS / RssAnon / RssFile after loading the policy and trainer, just before update;
- update_peak_rss: VmHWM after resetting it just before the update (`/proc/self/clear_refs`),
  i.e. the peak resident set during the update alone (None where the kernel refuses the reset);
- update_peak_anon / update_peak_file: the highest RssAnon / RssFile sampled every millisecond
  during the update (anonymous memory: Python objects and torch tensors; file: mapped pages,
  such as the memory-mapped rollout parts, which the kernel can drop at will).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
from pathlib import Path


def _status() -> dict[str, int]:
    """The kB fields of /proc/self/status we read, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakSampler(threading.Thread):
    def __init__(self, interval: float = 0.001):
        super().__init__(daemon=True)
        self.interval = interval
        self.peak: dict[str, int] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            for key, value in _status().items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            self._done.wait(self.interval)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


def main(run_root: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch

    from flowgrpo_cli.stages import update
    from flowgrpo_cli.store.config import load_config
    from flowgrpo_cli.store.rundir import RunDir
    from flowgrpo_cli.training.policy import load_policy
    from flowgrpo_cli.training.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run = RunDir(Path(run_root))
    config = load_config(run.config_path)
    policy = load_policy(config, torch.device("cpu"))
    trainer = Trainer(config, policy)
    before = _status()
    reset = _reset_peak()
    sampler = PeakSampler()
    sampler.start()
    result = update.run(config, run, 0, trainer)
    peak = sampler.stop()
    after = _status()
    print(
        json.dumps(
            {
                "samples": int(result.manifest["counts"]["samples"]),
                "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "before_rss": before["VmRSS"],
                "before_anon": before["RssAnon"],
                "before_file": before["RssFile"],
                "update_peak_rss": after["VmHWM"] if reset else None,
                "update_peak_anon": max(peak.get("RssAnon", 0), after["RssAnon"]),
                "update_peak_file": max(peak.get("RssFile", 0), after["RssFile"]),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
