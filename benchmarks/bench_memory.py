"""3. The update's peak memory at 1x and 8x the samples per iteration.

Two runs of the shared tiny config differ only in prompts per iteration: 2 and 16 groups of 8,
i.e. 16 and 128 samples. This process rolls both out and scores them; then each update runs in
a fresh interpreter (`benchmarks.memory_child`, both at once: memory does not depend on how
fast they run) and reports its peak resident set (ru_maxrss) and, sampled during the update
alone, its anonymous memory (Python objects and torch tensors) and mapped file pages (the
memory-mapped rollout parts, which the kernel may drop at any time).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from benchmarks.common import (
    REPO,
    Context,
    Report,
    Row,
    child_env,
    engine_for,
    fmt_mb,
    fmt_ratio,
    goal_check,
    make_run,
)
from flowgrpo_cli.store.rundir import ROLLOUT

GOAL = 1.10
GROUPS = {"1x": 2, "8x": 16}
SMOKE_GROUPS = {"1x": 1, "8x": 2}  # --smoke


def run(ctx: Context, report: Report, shared: dict) -> None:
    from flowgrpo_cli.stages import rollout, score
    from flowgrpo_cli.training.policy import load_policy

    runs, children = {}, {}
    policy = None
    try:
        for name, groups in (SMOKE_GROUPS if ctx.smoke else GROUPS).items():
            config, run_dir = make_run(
                ctx.workdir / f"memory-{name}",
                ctx.model(),
                *ctx.shared_overrides,
                f"algorithm.prompts_per_iteration={groups}",
                "sampler.train_fraction=0.2",  # one trained step: memory, not time, is measured
            )
            policy = policy or load_policy(config, torch.device("cpu"))  # base weights
            rollout.run(config, run_dir, 0, engine_for(policy, config))
            score.run(config, run_dir, 0)
            runs[name] = run_dir
            # Start it now: it imports while this process rolls out the next run.
            children[name] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.memory_child", str(run_dir.root)],
                cwd=REPO,
                env=child_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        del policy
        results = {}
        for name, child in children.items():
            out, err = child.communicate(timeout=600)
            if child.returncode:
                raise RuntimeError(f"memory child {name} failed:\n{err[-2000:]}")
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for child in children.values():  # after a failure, stop the others too
            if child.poll() is None:
                child.kill()
                child.wait()

    parts = {}
    for name, run_dir in runs.items():
        folder = run_dir.stage_dir(0, ROLLOUT)
        parts[name] = sum(p.stat().st_size for p in folder.glob("part-*.arrow"))
    small, large = results["1x"], results["8x"]
    # The peak during the update alone (VmHWM reset just before it); where the kernel refuses
    # the reset, the process's whole-life peak, ru_maxrss.
    key = "update_peak_rss" if large["update_peak_rss"] and small["update_peak_rss"] else None
    peak = key or "ru_maxrss"
    ratio = large[peak] / small[peak]
    what = (
        "peak RSS during update.run alone (VmHWM reset via /proc/self/clear_refs just before)"
        if key
        else "ru_maxrss of the whole process"
    )
    report.rows.append(
        Row(
            f"3. update peak RSS, {large['samples']} (A) vs {small['samples']} (B) samples",
            fmt_mb(large[peak]),
            fmt_mb(small[peak]),
            fmt_ratio(ratio),
            f"<= {GOAL:.2f}x",
            goal_check(ratio, GOAL),
            f"{what}, each in a fresh process that loads the policy and runs one update; "
            f"whole-process ru_maxrss {fmt_mb(large['ru_maxrss'])} vs "
            f"{fmt_mb(small['ru_maxrss'])} (set while loading the model). Rollout parts on "
            f"disk: {fmt_mb(parts['8x'])} vs {fmt_mb(parts['1x'])}",
        )
    )

    def growth(result: dict) -> float:
        return result["update_peak_anon"] - result["before_anon"]

    def file_growth(result: dict) -> float:
        return result["update_peak_file"] - result["before_file"]

    report.rows.append(
        Row(
            "3b. the update's own anonymous-memory growth, 8x (A) vs 1x (B)",
            fmt_mb(growth(large)),
            fmt_mb(growth(small)),
            fmt_ratio(growth(large) / max(growth(small), 1.0)),
            "-",
            "-",
            "peak RssAnon sampled every ms during update.run, minus RssAnon before it "
            "(Python objects + torch tensors; the parts' mapped pages are not anonymous). "
            f"Mapped file pages grew {fmt_mb(file_growth(large))} vs "
            f"{fmt_mb(file_growth(small))} (the parts, reclaimable page cache)",
        )
    )
