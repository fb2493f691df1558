"""`python -m benchmarks`: run every benchmark, print one table, write it as markdown.

    python -m benchmarks                      # all eight: 6-9 minutes on 2 shared cores
    python -m benchmarks --only rollout,arrow --reps 5
    python -m benchmarks --quick              # 2 rounds per comparison, 1 OCR round
    python -m benchmarks --only loop --loop-iterations 2
    python -m benchmarks --smoke --out /tmp/smoke.md   # each once, smallest sizes (tests)

See benchmarks/__init__.py for what each benchmark compares.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCHMARKS = ("rollout", "update", "arrow", "ocr", "memory", "loop", "algorithms", "plan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated subset of: {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed A/B rounds per comparison (default 6, --quick 2)",
    )
    parser.add_argument("--quick", action="store_true", help="2 timed rounds, 1 OCR round")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check that every benchmark runs: the smallest sizes, 1 round (numbers mean "
        "nothing; tests/test_benchmarks.py); writes no markdown unless --out is given",
    )
    parser.add_argument(
        "--loop-iterations",
        type=int,
        default=None,
        help="iterations of the loop benchmark (default 1)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="markdown file to write (default: benchmarks/results.md; none under --smoke)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="scratch folder (default: a new temporary folder, removed after)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")

    # Before torch is imported anywhere: one intra-op thread (see benchmarks.common.THREADS).
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from benchmarks import render
    from benchmarks.common import THREADS, Context, Report, load_average, machine, remove

    torch.set_num_threads(THREADS)
    _quiet()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="flowgrpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    quick = args.quick or args.smoke
    reps = args.reps or (1 if args.smoke else 2 if quick else 6)
    loop_iterations = args.loop_iterations or 1
    ctx = Context(
        workdir=workdir,
        reps=reps,
        quick=quick,
        loop_iterations=loop_iterations,
        smoke=args.smoke,
    )
    report = Report()
    info = machine()
    info["load"] = f"load average at start {load_average()}"
    started = time.perf_counter()
    shared: dict = {}
    failed = []
    try:
        for name in BENCHMARKS:
            if name not in chosen:
                continue
            if name == "update" and "rollout" not in chosen:
                _run_one("rollout", ctx, report, shared, failed, quiet=True)
            _run_one(name, ctx, report, shared, failed)
    finally:
        if not args.keep and args.workdir is None:
            remove(workdir)
    info["load"] += f", at end {load_average()}"
    # Run order puts the long subprocess benchmarks last; the table follows their numbers.
    report.rows.sort(key=lambda row: _number(row.benchmark))
    report.sections.sort(key=lambda section: _number(section.title))
    info["duration"] = f"{(time.perf_counter() - started) / 60:.1f} min"
    text = render.markdown(report, info, chosen, reps)
    print(render.console_table(report))
    for section in report.sections:
        print(render.console_section(section))
    out = args.out or (None if args.smoke else Path(__file__).parent / "results.md")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(
        f"\n{f'wrote {out}' if out else 'no markdown written'} ({info['duration']}); workdir "
        f"{'kept at ' + str(workdir) if args.keep or args.workdir else 'removed'}"
    )
    for name, error in failed:
        print(f"benchmark {name} FAILED: {error}", file=sys.stderr)
    return 1 if failed else 0


def _run_one(name: str, ctx, report, shared: dict, failed: list, quiet: bool = False) -> None:
    import importlib

    from benchmarks.common import Report

    module = importlib.import_module(f"benchmarks.bench_{name}")
    print(f"[bench] {name} ...", flush=True)
    start = time.perf_counter()
    target = Report() if quiet else report  # a prerequisite run: its rows are not reported
    try:
        module.run(ctx, target, shared)
    except Exception as err:  # one broken benchmark must not hide the others' results
        traceback.print_exc()
        failed.append((name, f"{type(err).__name__}: {err}"))
        return
    print(f"[bench] {name} done in {time.perf_counter() - start:.0f} s", flush=True)


def _number(title: str) -> int:
    digits = re.match(r"\d+", title)
    return int(digits.group()) if digits else 99


def _quiet() -> None:
    """Model loading prints progress bars and warnings that would bury the table."""
    import warnings

    warnings.filterwarnings("ignore")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
