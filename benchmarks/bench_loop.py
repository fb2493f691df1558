"""4. The resident loop against the same stages run as separate commands.

Two copies of one prepared run (the shared tiny config, with the `ocr` reward the paper trains
on). A: `flowgrpo loop --iterations K` in one subprocess. B: `flowgrpo rollout`, `score` and
`update` as separate subprocesses, iteration after iteration, on the other copy. Both sides
write the same files; each command pays for starting Python, importing torch / diffusers and
loading the model, which the loop pays once.

The loop's per-iteration time is the one it prints ("iteration N | S s"); each stage's share of
it comes from the stage's own `*/seconds` metric in RUN/iter-N/*/metrics.json (rollout and score
time their work; update times its training loop; the rest of the iteration is stage set-up,
the checkpoint, the sample grid and the metrics log).
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import time

from benchmarks.common import (
    REPO,
    Context,
    Report,
    Row,
    Section,
    child_env,
    flowgrpo_command,
    fmt_ratio,
    fmt_s,
    make_run,
)
from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, UPDATE

# (command, stage, its seconds metric)
STAGES = (("rollout", ROLLOUT, "rollout/seconds"), ("score", SCORE, "score/seconds"),
          ("update", UPDATE, "update/seconds"))  # fmt: skip
ITERATION_LINE = re.compile(r"iteration (\d+) \| ([\d.]+) s")


def _overrides(ctx: Context) -> list[str]:
    out = [o for o in ctx.shared_overrides if not o.startswith("reward.weights")]
    return [*out, "reward.weights={ocr = 1.0}", "reward.ocr_workers=1"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _command(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one `flowgrpo` subprocess."""
    start, start_cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run(
        [*flowgrpo_command(), *args], cwd=REPO, env=child_env(), capture_output=True, text=True
    )
    seconds, cpu = time.perf_counter() - start, _children_cpu() - start_cpu
    if done.returncode:
        raise RuntimeError(f"flowgrpo {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return seconds, cpu, done.stdout


def _stage_seconds(run_dir, iteration: int) -> dict[str, float]:
    out = {}
    for command, stage, key in STAGES:
        path = run_dir.stage_dir(iteration, stage) / "metrics.json"
        out[command] = float(json.loads(path.read_text()).get(key, 0.0))
    return out


def run(ctx: Context, report: Report, shared: dict) -> None:
    iterations = ctx.loop_iterations
    _, resident = make_run(ctx.workdir / "loop-resident", ctx.model(), *_overrides(ctx))
    _, separate = make_run(ctx.workdir / "loop-commands", ctx.model(), *_overrides(ctx))

    loop_wall, loop_cpu, stdout = _command(
        ["loop", "--run", str(resident.root), "--iterations", str(iterations)]
    )
    loop_iterations = {int(n): float(s) for n, s in ITERATION_LINE.findall(stdout)}
    command_walls: list[dict[str, float]] = []
    commands_cpu = 0.0
    for _ in range(iterations):
        walls = {}
        for command, _, _ in STAGES:
            walls[command], cpu, _ = _command([command, "--run", str(separate.root)])
            commands_cpu += cpu
        command_walls.append(walls)

    commands_total = sum(sum(w.values()) for w in command_walls)
    last = iterations - 1
    last_loop = loop_iterations.get(last, float("nan"))
    last_commands = sum(command_walls[last].values())
    startup = loop_wall - sum(loop_iterations.values())
    per_command = [
        command_walls[i][c] - _stage_seconds(separate, i)[c]
        for i in range(iterations)
        for c, _, _ in STAGES
    ]
    report.rows.append(
        Row(
            f"4. resident loop vs separate commands, {iterations} iteration(s)",
            fmt_s(loop_wall),
            fmt_s(commands_total),
            f"{fmt_ratio(loop_wall / commands_total)} (CPU {fmt_ratio(loop_cpu / commands_cpu)})",
            "-",
            "-",
            f"A: one `flowgrpo loop` process ({fmt_s(startup)} of it start-up and model "
            f"loading); B: {3 * iterations} commands. Iteration {last}: loop "
            f"{fmt_s(last_loop)} vs the 3 commands {fmt_s(last_commands)} "
            f"({fmt_ratio(last_loop / last_commands)}); each command spends "
            f"{min(per_command):.1f}-{max(per_command):.1f} s outside its stage's own work "
            "(interpreter, imports, model and reward set-up). Single round (each side costs "
            "minutes)",
        )
    )

    rows = []
    for i in range(iterations):
        wall = loop_iterations.get(i, float("nan"))
        seconds = _stage_seconds(resident, i)
        rest = wall - sum(seconds.values())
        cells = [f"{seconds[c]:.2f} ({seconds[c] / wall:.0%})" for c, _, _ in STAGES]
        rows.append(
            [f"loop, iteration {i}", f"{wall:.2f}", *cells, f"{rest:.2f} ({rest / wall:.0%})"]
        )
    for i in range(iterations):
        seconds = _stage_seconds(separate, i)
        walls = command_walls[i]
        cells = [f"{walls[c]:.2f} (own work {seconds[c]:.2f})" for c, _, _ in STAGES]
        rows.append([f"commands, iteration {i}", f"{sum(walls.values()):.2f}", *cells, "-"])
    report.sections.append(
        Section(
            "4. Loop vs commands: each stage's share (seconds)",
            ["", "iteration wall", "rollout", "score", "update", "rest of the iteration"],
            rows,
            "Loop rows: the iteration time the loop prints, and each stage's own `*/seconds` "
            "metric with its share; the rest is stage set-up and manifests, the update's "
            "checkpoint, the sample grid and the metrics log. Command rows: each command's "
            "wall time as a subprocess, with the stage's own seconds inside it; the "
            f"difference is start-up. The loop process also spent {fmt_s(startup)} before "
            "its first iteration and after its last (imports, the policy, the OCR engine).",
        )
    )
