"""The learning benchmark: RL algorithms on the toy OCR base for the same training time, beside
continued pre-training of the same base, as held-out OCR accuracy against training minutes.

Each RL arm is `flowgrpo loop` with its config in examples/toy_ocr/ (rl.toml for flow_grpo,
rl_<arm>.toml for the others), run in
chunks of its `eval.every` iterations until its training time passes --minutes; the loop itself
evaluates the policy between chunks (ODE, fixed noise, the run's eval settings). The baseline arm
`pretrain` continues pre-training the base with pretrain.py (--init-from: the base folder, a
fresh optimizer) and saves a checkpoint every --pretrain-every steps; each checkpoint is scored
by the same flowgrpo evaluation as the RL arms (`flowgrpo loop -n 0` with the checkpoint as the
model), so every curve has one evaluator, one noise and one set of prompts.

Minutes are training time: an RL iteration's rollout, score and update (its metrics), and
pre-training's steps (pretrain.py's own count); evaluation, model loading and pre-training's
latent encoding are left out of both. Arms run --parallel at a time, --threads torch threads
each: the defaults (3 arms of 1 thread) give each arm about two thirds of a 2-core machine,
so that all six arms finish in about 80 minutes; --parallel 2 gives each a core.

--split val scores on prompts/val.txt (targets never seen in pre-training, kept apart from the
held-out ones) and is what settings were chosen on; --split test is the held-out result.

Writes OUT/<arm>/curve.jsonl per arm, OUT/learn.png (every arm on one chart) and OUT/learn.md
(a table of the accuracy each arm reached by each mark, then one of each arm's best gain,
minutes to +10 points and gain per minute against pre-training's). --report-only redraws
both from the runs as they stand; --with NAME=RUN adds an arm of another learn folder (a
variant run with --set, or an arm's curve at another CFG scale from rescore.py) to them.

Run (the result of docs/experiments.md; then one arm on the validation prompts):
    python examples/toy_ocr/learn.py --out runs/learn
    python examples/toy_ocr/learn.py --minutes 10 --arms nft --split val --out runs/learn-val
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE / "base"
SPLITS = {"val": HERE / "prompts" / "val.txt", "test": HERE / "prompts" / "test.txt"}
# In the order they start: the best RL arm, Flow-GRPO and the baseline share the machine from
# start to end, the other algorithms follow as they finish.
ARMS = ("awm", "flow_grpo", "pretrain", "nft", "grpo_guard", "mixgrpo")
STAGE_SECONDS = ("rollout/seconds", "score/seconds", "update/seconds")
START_EVAL = Path("eval/iter-000000/metrics.json")  # a run's evaluation of the model it starts from


@dataclass(frozen=True)
class Point:
    """One evaluation of an arm."""

    minutes: float  # training time before it
    accuracy: float  # mean OCR reward: 1 - normalised edit distance
    exact: float  # the share of images read exactly
    step: int  # RL iteration or pre-training step


def rl_config(arm: str) -> Path:
    return HERE / ("rl.toml" if arm == "flow_grpo" else f"rl_{arm}.toml")


def flowgrpo() -> str:
    """The flowgrpo next to this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("flowgrpo")
    return str(beside) if beside.exists() else "flowgrpo"


def rl_curve(run: Path) -> list[Point]:
    """The evaluations in RUN/metrics.jsonl, each at the training minutes before it."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seconds_before: dict[int, float] = {0: 0.0}
    total = 0.0
    for line in sorted(lines, key=lambda line: line["iteration"]):
        total += sum(line.get(key, 0.0) for key in STAGE_SECONDS)
        seconds_before[line["iteration"] + 1] = total
    return [
        Point(
            seconds_before[line["iteration"]] / 60,
            line["eval/ocr_mean"],
            line["eval/ocr_exact"],
            line["iteration"],
        )
        for line in lines
        if "eval/ocr_mean" in line
    ]


def run_rl(
    arm: str, out: Path, minutes: float, split: Path, threads: int, overrides: Sequence[str]
) -> list[Point]:
    config = rl_config(arm)
    every = tomllib.loads(config.read_text())["eval"]["every"]
    run, log = out / arm, out / f"{arm}.log"
    sets = [f"data.test={split}", "eval.num_prompts=0", *overrides]
    sets = [arg for key in sets for arg in ("--set", key)]
    iterations = 0
    while True:
        loop = ["loop", "--config", str(config), "--run", str(run), "-n", str(iterations)]
        call([flowgrpo(), *loop, *sets], threads, log)
        curve = rl_curve(run)
        if curve[-1].minutes >= minutes:
            return curve
        iterations += every


def run_pretrain(
    out: Path, minutes: float, split: Path, threads: int, every: int, base: Path
) -> list[Point]:
    run, log = out / "pretrain", out / "pretrain.log"
    resume = ["--resume"] if (run / "state.pt").exists() else []
    options = ["--minutes", str(minutes), "--eval-every", str(every), "--threads", str(threads)]
    # Its own evaluation of 10 prompts only: the curve is flowgrpo's evaluation, below.
    options += ["--eval-prompts", "10", *resume]
    pretrain = [sys.executable, str(HERE / "pretrain.py"), "--out", str(run)]
    call([*pretrain, "--init-from", str(base), *options], threads, log)
    scored = out / "pretrain-eval"
    points = [Point(0.0, *_pretrain_eval(base, scored / "step-00000", split, threads, log), 0)]
    for line in (run / "eval.jsonl").read_text().splitlines():
        record = json.loads(line)
        name = f"step-{record['step']:05d}"
        checkpoint = run / "checkpoints" / name
        accuracy = _pretrain_eval(checkpoint, scored / name, split, threads, log)
        points.append(Point(record["train_minutes"], *accuracy, record["step"]))
    return points


def _pretrain_eval(
    model: Path, run: Path, split: Path, threads: int, log: Path
) -> tuple[float, float]:
    """(accuracy, exact) of a pipeline folder under the RL arms' evaluation (rl.toml's eval
    settings and seed)."""
    sets = [f"model.path={model}", f"data.test={split}", "eval.num_prompts=0"]
    return flowgrpo_eval(rl_config("flow_grpo"), run, sets, threads, log)


def flowgrpo_eval(
    config: Path, run: Path, sets: Sequence[str], threads: int, log: Path
) -> tuple[float, float]:
    """(accuracy, exact) of `flowgrpo loop -n 0` under CONFIG and SETS into the new run folder
    RUN: the loop evaluates the model it starts from (model.path) and stops."""
    loop = ["loop", "--config", str(config), "--run", str(run), "-n", "0"]
    call([flowgrpo(), *loop, *(arg for key in sets for arg in ("--set", key))], threads, log)
    return eval_of(run)


def eval_of(run: Path) -> tuple[float, float]:
    """(accuracy, exact) of the evaluation `flowgrpo loop -n 0` wrote into RUN."""
    metrics = json.loads((run / START_EVAL).read_text())
    return metrics["eval/ocr_mean"], metrics["eval/ocr_exact"]


def call(argv: list[str], threads: int, log: Path) -> None:
    """Run a command with `threads` torch threads, its output appended to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with log.open("a") as out:
        if subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"failed: {' '.join(argv)} (its output: {log})")


def run_arm(arm: str, options: argparse.Namespace) -> list[Point]:
    split = SPLITS[options.split]
    if arm == "pretrain":
        curve = run_pretrain(
            options.out, options.minutes, split, options.threads, options.pretrain_every, BASE
        )
    else:
        curve = run_rl(arm, options.out, options.minutes, split, options.threads, options.set)
    write_curve(curve, options.out / arm / "curve.jsonl")
    print(f"{arm}: " + ", ".join(f"{p.minutes:.1f} min {p.accuracy:.3f}" for p in curve))
    return curve


def write_curve(curve: list[Point], path: Path) -> None:
    with path.open("w") as f:
        f.writelines(json.dumps(asdict(point)) + "\n" for point in curve)


def has_curve(run: Path) -> bool:
    """A finished arm (curve.jsonl) or an RL run with evaluations so far (metrics.jsonl)."""
    return (run / "curve.jsonl").is_file() or (run / "metrics.jsonl").is_file()


def curve_so_far(run: Path) -> list[Point]:
    """An arm's curve as it stands: its curve.jsonl when it finished, else (an RL arm stopped
    early) the evaluations its run holds."""
    saved = run / "curve.jsonl"
    if saved.is_file():
        return [Point(**json.loads(line)) for line in saved.read_text().splitlines()]
    return rl_curve(run)


def arm_label(arm: str, out: Path) -> str:
    """The arm's name, with its CFG scales where its run samples or is scored at another scale
    than the evaluation's usual 4."""
    config = out / arm / "config.toml"
    if arm == "pretrain" or not config.is_file():
        return arm
    scales = tomllib.loads(config.read_text())
    sampled, scored = scales["sampler"]["guidance_scale"], scales["eval"]["guidance_scale"]
    return (
        arm
        if sampled == scored == 4
        else f"{arm}, sampled at CFG {sampled:g}, scored at {scored:g}"
    )


def extra_arm(spec: str) -> tuple[str, Path]:
    """`NAME=RUN` of --with: an arm of another learn folder, shown under NAME."""
    name, sep, run = spec.partition("=")
    if not sep or not name or not has_curve(Path(run)):
        raise SystemExit(f"--with {spec!r}: expected NAME=RUN, RUN an arm's folder of a learn run")
    return name, Path(run)


def level(spec: str) -> tuple[str, float]:
    """`LABEL=ACCURACY` of --level."""
    label, _, value = spec.rpartition("=")
    try:
        accuracy = float(value)
    except ValueError:
        accuracy = -1.0
    if not label or not 0 <= accuracy <= 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected LABEL=ACCURACY, e.g. 'base=0.567'")
    return label, accuracy


def accuracy_by(curve: list[Point], minutes: float) -> Point:
    """The last evaluation at or before `minutes` of training."""
    return [point for point in curve if point.minutes <= minutes + 1e-9][-1]


def write_table(curves: dict[str, list[Point]], marks: Sequence[float], path: Path) -> None:
    header = "| arm | " + " | ".join(f"{m:g} min" for m in marks) + " | best (exact) |"
    lines = [header, "|---" * (len(marks) + 2) + "|"]
    for arm, curve in curves.items():
        # "-": the arm stopped (or was stopped) before that mark.
        cells = [
            f"{accuracy_by(curve, m).accuracy:.3f}" if m <= curve[-1].minutes + 1e-9 else "-"
            for m in marks
        ]
        best = max(curve, key=lambda p: p.accuracy)
        lines.append(
            f"| {arm} | "
            + " | ".join(cells)
            + f" | {best.accuracy:.3f} ({best.exact:.0%}) at {best.minutes:.1f} min |"
        )
    path.write_text("\n".join(lines) + "\n")


def summary_rows(curves: dict[str, list[Point]], minutes: float) -> list[str]:
    """A markdown table of each arm's gains within `minutes` of training (an arm's last chunk
    may run past it), in points of accuracy (1 point = 0.01) over the arm's own start (its
    evaluation at minute 0): the best gain, where it was reached, the minutes to the first
    gain of +10, the best gain per minute of training, and that rate against continued
    pre-training's when a `pretrain` arm is among the curves."""
    curves = {
        arm: [point for point in curve if point.minutes <= minutes + 1e-9]
        for arm, curve in curves.items()
    }

    def best_rate(curve: list[Point]) -> float | None:
        best = max(curve, key=lambda p: p.accuracy)
        gain = (best.accuracy - curve[0].accuracy) * 100
        return gain / best.minutes if best.minutes > 0 else None

    baseline = best_rate(curves["pretrain"]) if "pretrain" in curves else None
    rows = [
        "| arm | start | best gain (exact) | at | minutes to +10 | gain per minute "
        "| against pre-training |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, curve in curves.items():
        start, best = curve[0], max(curve, key=lambda p: p.accuracy)
        ten = next((p.minutes for p in curve if p.accuracy - start.accuracy >= 0.10 - 1e-9), None)
        rate = best_rate(curve)
        cells = [
            arm,
            f"{start.accuracy:.3f}",
            f"{(best.accuracy - start.accuracy) * 100:+.1f} ({best.exact:.0%})",
            f"{best.minutes:.1f} min",
            "never" if ten is None else f"{ten:.1f}",
            "-" if rate is None else f"{rate:+.2f}",
            "-" if rate is None or not baseline else f"{rate / baseline:.2f}x",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def plot(
    curves: dict[str, list[Point]],
    path: Path,
    title: str,
    xlabel: str,
    prompts: str,
    levels: Sequence[tuple[str, float]] = (),
) -> None:
    """Accuracy and exact-match rate against minutes; `levels` are (label, accuracy) lines drawn
    across the accuracy panel, such as the base's level and the goal above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    for arm, curve in curves.items():
        style = {"color": "black", "linestyle": "--"} if arm == "pretrain" else {}
        label = "continued pre-training" if arm == "pretrain" else arm
        minutes = [p.minutes for p in curve]
        left.plot(minutes, [p.accuracy for p in curve], marker="o", ms=3, label=label, **style)
        right.plot(minutes, [p.exact for p in curve], marker="o", ms=3, label=label, **style)
    for (label, accuracy), color in zip(
        levels, itertools.cycle(("gray", "firebrick", "darkgreen"))
    ):
        left.axhline(accuracy, color=color, linestyle=":", linewidth=1, label=label)
    left.set_ylabel(f"{prompts} OCR accuracy")
    right.set_ylabel("exact-match rate")
    for ax in (left, right):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.legend(*left.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="Training time per arm.")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"Comma list of {ARMS}.")
    parser.add_argument(
        "--split",
        choices=sorted(SPLITS),
        default="test",
        help="Prompts scored: val (choosing settings) or test (the result).",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/learn"), help="Folder of runs.")
    parser.add_argument("--parallel", type=int, default=3, help="Arms run at a time.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per arm.")
    parser.add_argument(
        "--pretrain-every", type=int, default=100, help="Pre-training steps between checkpoints."
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config override for every RL arm, as `flowgrpo loop --set` (repeatable).",
    )
    parser.add_argument(
        "--with",
        dest="extra",
        action="append",
        default=[],
        metavar="NAME=RUN",
        help="With --report-only: also chart RUN, an arm of another learn folder, as NAME.",
    )
    parser.add_argument(
        "--level",
        dest="levels",
        type=level,
        action="append",
        default=[],
        metavar="LABEL=ACCURACY",
        help="A horizontal line on the accuracy chart, e.g. 'base, CFG 4=0.567' (repeatable).",
    )
    parser.add_argument("--fresh", action="store_true", help="Delete OUT's runs first.")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="Only write the chart and table from the arms' runs in OUT as they stand.",
    )
    options = parser.parse_args(argv)
    arms = [arm.strip() for arm in options.arms.split(",") if arm.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if options.extra and not options.report_only:
        parser.error("--with charts finished runs: use it with --report-only")
    if options.fresh:
        shutil.rmtree(options.out, ignore_errors=True)
    options.out.mkdir(parents=True, exist_ok=True)
    if options.report_only:
        missing = [arm for arm in arms if not has_curve(options.out / arm)]
        if missing:
            parser.error(f"--report-only: no run of {', '.join(missing)} in {options.out}")
        curves = {arm_label(arm, options.out): curve_so_far(options.out / arm) for arm in arms}
        curves |= {name: curve_so_far(run) for name, run in map(extra_arm, options.extra)}
    else:
        with ThreadPoolExecutor(options.parallel) as pool:
            runs = pool.map(lambda arm: run_arm(arm, options), arms)
            curves = {arm_label(arm, options.out): run for arm, run in zip(arms, runs, strict=True)}
    marks = [m for m in (5, 10, 15, 20, 30, 45, 60) if m < options.minutes] + [options.minutes]
    write_table(curves, marks, options.out / "learn.md")
    with (options.out / "learn.md").open("a") as table:
        table.write("\n" + "\n".join(summary_rows(curves, options.minutes)) + "\n")
    prompts = {"test": "held-out", "val": "validation"}[options.split]
    title = f"toy OCR base, {prompts} prompts, ODE, CFG 4 unless named"
    xlabel = f"training minutes ({options.parallel} arms at a time, {options.threads} thread each)"
    plot(curves, options.out / "learn.png", title, xlabel, prompts, options.levels)
    print(f"wrote {options.out / 'learn.md'} and {options.out / 'learn.png'}")


if __name__ == "__main__":
    sys.exit(main())
