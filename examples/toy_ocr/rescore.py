"""Score an RL arm's checkpoints again at other CFG scales.

A policy sampled, trained and evaluated without CFG (`--set sampler.guidance_scale=1 --set
eval.guidance_scale=1`) may read better with some guidance on top at inference, as the base does
(0.357 at CFG 1, 0.567 at CFG 4 on the held-out prompts). The scale to report is a setting like
any other: choose it on the validation prompts, then apply it to the held-out run.

For every evaluation the arm's loop made (every --stride-th, and always the last), the policy it
evaluated, checkpoints/iter-(N-1) (the run's base model for N = 0), is exported as a pipeline by
`flowgrpo export` and evaluated by `flowgrpo loop -n 0` under the run's own config at each
--guidance scale: the loop's evaluation (prompts, noise, steps) but for the scale, so at the
run's own scale it repeats the run's curve. Writes RUN/rescored/cfg<G>/curve.jsonl,
each point at the training minutes of the evaluation it repeats: an arm that
`learn.py --report-only --with NAME=RUN/rescored/cfg<G>` charts. Scores already written are
reused, so a stopped rescore resumes and a new scale costs only its own evaluations.

Run (the sweep on the validation run, then the chosen scale on the held-out run):
    python examples/toy_ocr/rescore.py runs/val-cfg1/awm --guidance 1,2,3,4
    python examples/toy_ocr/rescore.py runs/test-cfg1/awm --guidance 2
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

from learn import START_EVAL, Point, call, eval_of, flowgrpo, flowgrpo_eval, rl_curve, write_curve


def scales(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected CFG scales of at least 1")
    return values


def evaluations(run: Path, stride: int) -> list[Point]:
    """Every stride-th evaluation of RUN's loop, and its last."""
    if not (run / "metrics.jsonl").is_file():
        raise SystemExit(f"{run}: no metrics.jsonl, not an RL arm of learn.py")
    curve = rl_curve(run)
    if not curve:
        raise SystemExit(f"{run}: its loop has not evaluated yet")
    chosen = curve[::stride]
    return chosen if chosen[-1] == curve[-1] else [*chosen, curve[-1]]


def rescore(
    run: Path, guidance: Sequence[float], stride: int, threads: int
) -> dict[float, list[Point]]:
    base = Path(tomllib.loads((run / "config.toml").read_text())["model"]["path"])
    out = run / "rescored"
    out.mkdir(exist_ok=True)
    log = out / "rescore.log"
    curves: dict[float, list[Point]] = {scale: [] for scale in guidance}
    for point in evaluations(run, stride):
        name = f"iter-{point.step:06d}"
        export = out / "exports" / name
        for scale in guidance:
            folder = out / f"cfg{scale:g}" / name
            if (folder / START_EVAL).is_file():
                accuracy, exact = eval_of(folder)
            else:
                model = base if point.step == 0 else _exported(run, point.step - 1, export, log)
                sets = [f"model.path={model}", f"eval.guidance_scale={scale}"]
                accuracy, exact = flowgrpo_eval(run / "config.toml", folder, sets, threads, log)
            curves[scale].append(Point(point.minutes, accuracy, exact, point.step))
            print(f"{name} cfg {scale:g}: {accuracy:.3f} ({exact:.0%} exact)", flush=True)
        shutil.rmtree(export, ignore_errors=True)  # scored at every scale: only the scores stay
    for scale, points in curves.items():
        write_curve(points, out / f"cfg{scale:g}" / "curve.jsonl")
    return curves


def _exported(run: Path, iteration: int, folder: Path, log: Path) -> Path:
    """The pipeline of checkpoint `iteration`, exported once."""
    if not (folder / "model_index.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)  # an export that was cut off
        folder.parent.mkdir(parents=True, exist_ok=True)
        call(
            [flowgrpo(), "export", str(run), str(folder), "-i", str(iteration), "--merged"], 1, log
        )
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="An RL arm's run folder of learn.py (OUT/ARM).")
    parser.add_argument(
        "--guidance", type=scales, required=True, help="CFG scales, comma-separated: 1,2,3,4."
    )
    parser.add_argument(
        "--stride", type=int, default=1, help="Rescore every STRIDE-th evaluation (and the last)."
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    options = parser.parse_args(argv)
    if options.stride < 1:
        parser.error("--stride: expected 1 or more")
    rescore(options.run, options.guidance, options.stride, options.threads)


if __name__ == "__main__":
    sys.exit(main())
