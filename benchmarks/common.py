"""What every benchmark shares: result rows, A/B timing, section timers, the tiny run.

The benchmarks run on a shared machine whose load we do not control, so nothing here makes an
absolute claim. Each comparison runs its sides in the same process (or from the same parent)
in alternation, A B B A A B ..., and reports the median of each side and the median of the
per-round ratios A_i / B_i: a pair runs back to back, so a load spike moves both sides of it.
Process CPU time is recorded next to wall time: time lost to other processes does not count in
it. No number is asserted; the goal column says what we aim for and the table says whether the
measurement met it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPTS_TRAIN = REPO / "examples" / "ocr" / "train.txt"
PROMPTS_TEST = REPO / "examples" / "ocr" / "test.txt"

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP threads
# that spin-wait for a busy core make timings erratic (tests/conftest.py does the same). Both
# sides of every comparison run with one thread; subprocesses inherit it through this variable.
THREADS = 1


def child_env() -> dict[str, str]:
    """Environment of benchmark subprocesses: offline hub, one thread, wide plain output."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS=str(THREADS),
        COLUMNS="200",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
    )
    return env


def flowgrpo_command() -> list[str]:
    """The `flowgrpo` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "flowgrpo"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flowgrpo_cli"]


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class Row:
    """One line of the results table."""

    benchmark: str
    a: str  # what A measured, with its unit
    b: str
    ratio: str
    goal: str
    met: str  # "yes", "no (+x%)", or "-" when there is no goal
    note: str = ""


@dataclass
class Section:
    """A sub-table printed under the main table (a breakdown, shares of a whole)."""

    title: str
    header: list[str]
    rows: list[list[str]]
    text: str = ""  # a paragraph under the table


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)


def goal_check(ratio: float, limit: float) -> str:
    """'yes' when ratio <= limit, else 'no' with the excess over the goal."""
    if ratio <= limit:
        return "yes"
    return f"no (+{(ratio / limit - 1) * 100:.0f}% over)"


def goal_both(timings: Timings, a: str, b: str, limit: float) -> str:
    """The goal check on wall time, and on CPU time when that verdict differs."""
    wall = goal_check(timings.ratio(a, b), limit)
    cpu = goal_check(timings.cpu_ratio(a, b), limit)
    if wall.split()[0] == cpu.split()[0]:
        return wall
    return f"{wall}; CPU time: {cpu}"


def fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 100 else f"{seconds:.0f} s"


def fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}x"


def fmt_mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Alternating A/B timing


@dataclass(frozen=True)
class Side:
    """One side of a comparison: `run` is timed; `reset` (untimed) runs before each call."""

    run: Callable[[], Any]
    reset: Callable[[], None] | None = None


@dataclass(frozen=True)
class Timings:
    """Wall and process CPU seconds of every timed run, per side, in run order.

    CPU time counts only the time this process ran, so another process taking the core from
    it does not count; it leaves out waits too (fsync, other processes' work).
    """

    seconds: dict[str, list[float]]
    cpu: dict[str, list[float]]
    profiles: dict[str, list[SectionTimers]]  # one per timed run, when profiled

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratio(self, a: str, b: str) -> float:
        """Median of the per-round wall-time ratios a_i / b_i (the two ran back to back)."""
        return _paired_ratio(self.seconds[a], self.seconds[b])

    def cpu_ratio(self, a: str, b: str) -> float:
        return _paired_ratio(self.cpu[a], self.cpu[b])

    def ratio_text(self, a: str, b: str) -> str:
        return f"{fmt_ratio(self.ratio(a, b))} (CPU {fmt_ratio(self.cpu_ratio(a, b))})"

    def spread(self, name: str) -> str:
        values = self.seconds[name]
        return f"{min(values):.2f}-{max(values):.2f} s"


def _paired_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def alternate(
    sides: dict[str, Side],
    reps: int,
    warmup: int = 1,
    profile: Callable[[], SectionTimers] | None = None,
) -> Timings:
    """Run every side `warmup` times untimed, then `reps` timed rounds; the order of the sides
    reverses every round (A B, B A, A B ...) so a trend in the machine's load cancels out.

    With `profile` (a factory of patched SectionTimers), every timed run records its parts;
    the patches cost a few microseconds per wrapped call (see `timer_overhead`).
    """
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            _timed(sides[name], None)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    profiles: dict[str, list[SectionTimers]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else list(reversed(names)):
            timers = profile() if profile is not None else None
            wall, used = _timed(sides[name], timers)
            seconds[name].append(wall)
            cpu[name].append(used)
            if timers is not None:
                profiles[name].append(timers)
    return Timings(seconds, cpu, profiles)


def _timed(side: Side, timers: SectionTimers | None) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call of the side."""
    if side.reset is not None:
        side.reset()
    try:
        start, start_cpu = time.perf_counter(), time.process_time()
        side.run()
        return time.perf_counter() - start, time.process_time() - start_cpu
    finally:
        if timers is not None:
            timers.close()


# ---------------------------------------------------------------------------------------------
# Section timers: exclusive time per labelled function, by patching them for one profiled run


Label = str | Callable[..., str]


class SectionTimers:
    """Wraps functions so each call adds its own time, minus that of wrapped calls inside it,
    to its label: the labels of one run then add up to the covered part of its wall time.

    Calls on other threads than the main one are kept apart, under "LABEL (writer thread)",
    and listed in `background`: their time overlaps the main thread's, so it is not part of
    the wall time the main thread's labels add up to.

    Used for a separate profiled run only; the timed A/B runs are never patched.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.background: set[str] = set()
        self._local = threading.local()  # per thread: time of wrapped calls inside open calls
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()

    @property
    def _children(self) -> list[float]:
        if not hasattr(self._local, "children"):
            self._local.children = []
        return self._local.children

    def wrap(self, fn: Callable[..., Any], label: Label) -> Callable[..., Any]:
        """`fn`, timed under `label` (a string, or a function of fn's arguments)."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self._children.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._children.pop()
                name = label(*args, **kwargs) if callable(label) else label
                if threading.current_thread() is not threading.main_thread():
                    name = f"{name} (writer thread)"
                    self.background.add(name)
                with self._lock:
                    self.seconds[name] += elapsed - inner
                    self.calls[name] += 1
                if self._children:
                    self._children[-1] += elapsed

        return timed

    def patch(self, owner: Any, name: str, label: Label) -> None:
        """Replace owner.name (a module's function, or a class's method or staticmethod, maybe
        inherited) with its timed version until close()."""
        if not isinstance(owner, type):
            raw = getattr(owner, name)
            setattr(owner, name, self.wrap(raw, label))
            self._stack.callback(setattr, owner, name, raw)
            return
        raw = next(k.__dict__[name] for k in owner.__mro__ if name in k.__dict__)
        if isinstance(raw, staticmethod):
            replacement: Any = staticmethod(self.wrap(raw.__func__, label))
        else:
            replacement = self.wrap(raw, label)
        own = name in owner.__dict__
        setattr(owner, name, replacement)
        if own:
            self._stack.callback(setattr, owner, name, raw)
        else:  # inherited: removing the override restores it
            self._stack.callback(delattr, owner, name)

    def patch_item(self, mapping: dict, key: str, label: Label) -> None:
        original = mapping[key]
        mapping[key] = self.wrap(original, label)
        self._stack.callback(mapping.__setitem__, key, original)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SectionTimers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def breakdown_rows(
    timings: Timings, columns: list[tuple[str, str]], order: list[str]
) -> tuple[list[str], list[list[str]]]:
    """A sub-table: one row per label (in `order`, then any others), one column per side
    (title, side name): the median over the profiled runs of each part's exclusive wall
    seconds, its calls per run, the rest of the median wall time as "other", and the median
    process CPU time."""
    cpu = [statistics.median(timings.cpu[name]) for _, name in columns]
    columns = [(title, timings.profiles[name], timings.seconds[name]) for title, name in columns]
    seen = {label for _, runs, _ in columns for timers in runs for label in timers.seconds}
    labels = [label for label in order if label in seen] + sorted(seen - set(order))
    header = ["part", *[f"{title} (s, calls)" for title, _, _ in columns]]
    medians = [
        {label: statistics.median(t.seconds.get(label, 0.0) for t in runs) for label in seen}
        for _, runs, _ in columns
    ]
    rows = []
    for label in labels:
        cells = []
        for (_, runs, _), median in zip(columns, medians, strict=True):
            calls = runs[0].calls.get(label, 0)
            cells.append(f"{median[label]:.3f} ({calls}x)" if calls else "-")
        rows.append([label, *cells])
    walls = [statistics.median(w) for _, _, w in columns]
    background = {label for _, runs, _ in columns for timers in runs for label in timers.background}
    rows.append(
        ["other (untimed code)"]
        + [
            f"{wall - sum(v for k, v in m.items() if k not in background):.3f}"
            for wall, m in zip(walls, medians, strict=True)
        ]
    )
    rows.append(["**wall time (median)**"] + [f"**{wall:.3f}**" for wall in walls])
    rows.append(["process CPU time (median)"] + [f"{value:.3f}" for value in cpu])
    return header, rows


def largest_gaps(
    a: list[SectionTimers], b: list[SectionTimers], count: int = 3
) -> list[tuple[str, float]]:
    """The `count` parts whose median exclusive time exceeds B's the most, A - B seconds
    (main-thread parts only: a writer thread's time overlaps them)."""
    labels = {label for t in [*a, *b] for label in t.seconds} - {
        label for t in [*a, *b] for label in t.background
    }

    def median(runs: list[SectionTimers], label: str) -> float:
        return statistics.median(t.seconds.get(label, 0.0) for t in runs)

    deltas = {label: median(a, label) - median(b, label) for label in labels}
    return [(k, v) for k, v in sorted(deltas.items(), key=lambda kv: -kv[1])[:count] if v > 0]


def timer_overhead(calls: int = 20000) -> float:
    """Seconds one SectionTimers wrapper adds to a call (measured on a no-op)."""

    def noop() -> None:
        return None

    timers = SectionTimers()
    wrapped = timers.wrap(noop, "noop")
    start = time.perf_counter()
    for _ in range(calls):
        noop()
    bare = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        wrapped()
    return max(0.0, (time.perf_counter() - start - bare) / calls)


def total_calls(runs: list[SectionTimers]) -> int:
    return sum(runs[0].calls.values()) if runs else 0


# ---------------------------------------------------------------------------------------------
# The tiny model and prepared runs


def build_tiny_model(workdir: Path) -> Path:
    from flowgrpo_cli.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline("sd3", workdir / "tiny-sd3", seed=0)


def make_run(root: Path, model: Path, *overrides: str):
    """(Config, RunDir) of a prepared tiny SD3 run at `root`, as tests/conftest.py's make_run
    builds one: config.toml written as the CLI's first command would, then `prepare`."""
    from flowgrpo_cli.stages import prepare
    from flowgrpo_cli.store.config import dumps_config, load_config
    from flowgrpo_cli.store.rundir import RunDir

    config = load_config(
        None,
        [
            f"run.dir={root}",
            f"data.train={PROMPTS_TRAIN}",
            f"data.test={PROMPTS_TEST}",
            f"model.path={model}",
            "model.dtype=float32",
            "model.device=cpu",
            "eval.every=0",
            *overrides,
        ],
    )
    run = RunDir(root)
    root.mkdir(parents=True, exist_ok=True)
    run.config_path.write_text(dumps_config(config))
    prepare.run(config, run)
    return config, run


def engine_for(policy, config):
    from flowgrpo_cli.engines import build_engine

    return build_engine(config, policy)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ---------------------------------------------------------------------------------------------
# The machine


def machine() -> dict[str, str]:
    import torch

    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": f"{os.cpu_count()} logical ({usable} usable by this process)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": f"torch intra-op threads: {THREADS} (OMP_NUM_THREADS={THREADS} in subprocesses)",
        "commit": _git_commit(),
    }


def load_average() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip() or "unknown"
    return f"{commit}{' + local changes' if dirty.stdout.strip() else ''}"


# ---------------------------------------------------------------------------------------------
# What the benchmarks share within one `python -m benchmarks` run

# The tiny run of benchmarks 1-3: 64x64, 6 steps with CFG, T5 cut to 32 tokens (as the demo
# does), 4 prompts x 8 images in batches of 8, LoRA rank 8, micro-batches of 4, the paper's
# beta = 0.04 (so the update runs the reference forward). train_fraction 0.4 trains the first
# 2 of the 5 trainable steps (Flow-GRPO-Fast style), which keeps the update benchmark short.
SHARED_OVERRIDES = (
    "model.height=64",
    "model.width=64",
    "model.max_sequence_length=32",
    "sampler.num_steps=6",
    "sampler.guidance_scale=4.5",
    "sampler.noise_level=0.7",
    "sampler.batch_size=8",
    "algorithm.group_size=8",
    "algorithm.prompts_per_iteration=4",
    "algorithm.beta=0.04",
    "sampler.train_fraction=0.4",
    "train.micro_batch_size=4",
    "train.steps_per_epoch=2",
    "train.lora_rank=8",
    "train.lora_alpha=16",
    "reward.weights={jpeg_compressibility = 1.0}",
)

# `--smoke` (tests/test_benchmarks.py): the smallest run each benchmark's code allows, to check
# that it runs at all; its numbers mean nothing. 2 prompts x 2 images, 3 steps, on top of the
# shared overrides.
SMOKE_OVERRIDES = (
    "sampler.num_steps=3",
    "sampler.batch_size=2",
    "algorithm.group_size=2",
    "algorithm.prompts_per_iteration=2",
    "train.micro_batch_size=2",
    "train.steps_per_epoch=1",
)


@dataclass
class Context:
    workdir: Path
    reps: int  # timed A/B rounds per comparison
    quick: bool  # fewer OCR rounds
    loop_iterations: int  # iterations of the loop benchmark
    smoke: bool = False  # the smallest sizes: a check that every benchmark runs (--smoke)
    _model: Path | None = None
    _policy: Any = None

    @property
    def shared_overrides(self) -> tuple[str, ...]:
        """The shared tiny run's overrides (SMOKE_OVERRIDES on top under --smoke)."""
        return SHARED_OVERRIDES + SMOKE_OVERRIDES if self.smoke else SHARED_OVERRIDES

    def rounds(self, minimum: int) -> int:
        """Timed rounds of a comparison that needs at least `minimum` (but 1 under --smoke)."""
        return self.reps if self.smoke else max(self.reps, minimum)

    def model(self) -> Path:
        """The tiny SD3 pipeline folder, built on first use."""
        if self._model is None:
            self._model = build_tiny_model(self.workdir)
        return self._model

    def policy(self, config) -> Any:
        """One CPU policy (LoRA attached) for every in-process benchmark of the shared run."""
        if self._policy is None:
            import torch

            from flowgrpo_cli.training.policy import load_policy

            self._policy = load_policy(config, torch.device("cpu"))
        return self._policy
