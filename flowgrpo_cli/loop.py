"""`flowgrpo loop`: rollout -> score -> update, iteration after iteration, models resident.

The loop calls the very stage functions the standalone commands call, so it writes exactly
their files; it only keeps the policy, the trainer (optimizer, EMA) and the reward engines
alive between them. It starts at the run's first unfinished iteration, and each stage skips
what is already on disk, so a killed loop re-run with the same command resumes where it was
and ends with the same checkpoint bytes as an uninterrupted run.

After each held-out evaluation it records the best one so far (RUN/best.json, whose checkpoint
retention keeps) and applies the drift rule (store.evaluations): a warning line when the
training reward rose while the held-out reward fell, and with eval.stop_on_drift a clean stop
there. Both are derived from the stage folders, so a resumed loop agrees with an
uninterrupted one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from PIL import UnidentifiedImageError

from flowgrpo_cli.engines import build_engine, engine_class
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import (
    barrier,
    broadcast_object,
    dist_info,
    init_process_group,
    resolve_device,
)
from flowgrpo_cli.ray_cluster import pool_scorer_in_rank
from flowgrpo_cli.reporting.grid import (
    GRID_GROUPS,
    GRID_PER_GROUP,
    GridItem,
    edit_cells,
    make_grid,
)
from flowgrpo_cli.reporting.progress import NullProgress, Progress
from flowgrpo_cli.reporting.trackers import active_trackers, open_trackers, track
from flowgrpo_cli.store.config import Config
from flowgrpo_cli.store.contract import RolloutManifest, ScoreManifest
from flowgrpo_cli.store.datatable import source_images
from flowgrpo_cli.store.evaluations import best_evaluation, drift_by_evaluation, write_best
from flowgrpo_cli.store.metrics_log import read_log, rebuild
from flowgrpo_cli.store.retention import apply_retention
from flowgrpo_cli.store.rundir import (
    ROLLOUT,
    SCORE,
    RunDir,
    atomic_write_bytes,
    read_manifest,
    verify_stage,
)
from flowgrpo_cli.store.trajectory import iter_batches, read_table
from flowgrpo_cli.training.policy import load_policy, load_weights
from flowgrpo_cli.training.trainer import Trainer


@dataclass(frozen=True)
class IterationSummary:
    iteration: int
    metrics: dict[str, float]
    seconds: float
    score_failures: str = ""  # "4 of 32 images failed scoring (...)": empty when none did


def run_loop(
    config: Config,
    run: RunDir,
    iterations: int,
    *,
    progress: Progress | None = None,
    on_iteration=None,
    on_note=None,
) -> list[IterationSummary]:
    """Train until `iterations` are done (or eval.stop_on_drift stops the loop);
    `on_iteration(summary)` after each one and `on_note(text)` for what a user should know
    (the plan, drift warnings, the final evaluation, the best one; main rank only)."""
    from flowgrpo_cli.rewards.commands import build_rewards_from_config
    from flowgrpo_cli.stages import evaluate, prepare, rollout, score, update

    progress = progress or NullProgress()
    info = dist_info()
    tracked = active_trackers(config.log.trackers) if info.is_main else []  # before any work
    device = resolve_device(config.model.device)
    init_process_group(device)
    if read_manifest(run.data_dir) is None:
        if info.is_main:
            prepare.run(config, run)
        barrier()
    start = run.current_iteration()
    engine_class(config.sampler.engine)  # fails fast on a missing engine
    policy = load_policy(config, device)
    if start > 0:  # before sharding: the checkpoint holds full tensors
        load_weights(policy, run.checkpoint_dir(start - 1))
    trainer = Trainer(config, policy)
    if start > 0:
        trainer.load(run.checkpoint_dir(start - 1))
    engine = build_engine(config, policy)
    if info.is_main and on_note is not None and start < iterations:
        for line in plan_note(config, iterations):
            on_note(line)
    summaries = []
    with (
        build_rewards_from_config(config.reward) as rewards,
        open_trackers(config, run, tracked) as trackers,
    ):
        if _eval_due(config, start, iterations):
            with trainer.ema_weights():
                evaluate.run(config, run, start, engine, rewards, progress)
        stop = None  # the evaluation the loop stops at (eval.stop_on_drift)
        if info.is_main:  # what a kill after the last checkpoint left unwritten
            lines = write_logs(run, start, config)
            apply_retention(run, *_retention(config))
            write_best(run)
            ignored = config.eval.stop_on_drift and not _stops_on_drift(config)
            if on_note is not None and start < iterations and ignored:
                on_note(
                    "note: eval.stop_on_drift has no effect: it needs eval.drift_window >= 2 "
                    "and eval.every > 0"
                )
            if start < iterations:  # a loop that stopped here stops here again
                stop = _check_drift(config, run, lines, start, on_note)
        if start < iterations and _stops_on_drift(config):
            stop = broadcast_object(stop)  # every rank stops, or none
        for iteration in range(start, iterations):
            if stop is not None:
                break
            started = time.perf_counter()
            with trainer.sampling_weights():  # nft samples with its anchor
                rollout.run(config, run, iteration, engine, progress)
            scorer = pool_scorer_in_rank(config, run, iteration)  # None: the ranks score
            score.run(config, run, iteration, rewards, progress, parts_scorer=scorer)
            update.run(config, run, iteration, trainer, progress)
            evaluated = _eval_due(config, iteration + 1, iterations)
            if evaluated:
                with trainer.ema_weights():
                    evaluate.run(config, run, iteration + 1, engine, rewards, progress)
            barrier()
            if info.is_main:
                apply_retention(run, *_retention(config))  # keeps the best's checkpoint
                lines = write_logs(run, iteration + 1, config)
                write_best(run)
                latest = next(line for line in lines if line["iteration"] == iteration)
                track(trackers, run, latest)
                seconds = time.perf_counter() - started
                failures = (
                    score_failures(run, iteration) if latest.get("score/failed_images") else ""
                )
                summary = IterationSummary(iteration, latest, seconds, failures)
                summaries.append(summary)
                if on_iteration is not None:
                    on_iteration(summary)
                if evaluated:
                    stop = _check_drift(config, run, lines, iteration + 1, on_note)
                    if iteration + 1 == iterations:
                        stop = None  # the last evaluation: the loop ends here anyway
                    if stop is not None:  # no iteration's line will carry this evaluation
                        _report_final_evaluation(run, stop, trackers, on_note)
            if evaluated and iteration + 1 < iterations and _stops_on_drift(config):
                stop = broadcast_object(stop)  # every rank stops, or none
        if info.is_main:
            if stop is not None:
                _stop_message(run, stop, on_note)
            else:
                fresh = start < iterations or iterations == 0  # else the trackers have it
                _report_final_evaluation(run, iterations, trackers if fresh else [], on_note)
            _best_note(run, on_note)
    return summaries


def _stops_on_drift(config: Config) -> bool:
    """Whether eval.stop_on_drift can stop this loop: the drift rule on, evaluations made."""
    return config.eval.stop_on_drift and config.eval.drift_window > 0 and config.eval.every > 0


def _check_drift(
    config: Config, run: RunDir, lines: list[dict], evaluated: int, on_note
) -> int | None:
    """After the evaluation eval/iter-`evaluated`: one warning line when the drift rule
    (store.evaluations) finds the training reward rising while the held-out reward falls over
    the window ending there. Returns `evaluated` when the loop is to stop there
    (eval.stop_on_drift), else None."""
    from flowgrpo_cli.reporting.render import describe_drift

    window = config.eval.drift_window
    drift = drift_by_evaluation(lines, window).get(evaluated) if window else None
    if drift is None or not drift.drifting:
        return None
    if on_note is not None:
        on_note(f"warning: {describe_drift(drift)}")
    return evaluated if config.eval.stop_on_drift else None


def _stop_message(run: RunDir, evaluated: int, on_note) -> None:
    """Why the loop stopped before its last iteration, and where the best weights are."""
    if on_note is None:
        return
    from flowgrpo_cli.reporting.render import updates

    best = best_evaluation(run)
    if best is None:
        where = "no evaluation counts as best"
    elif best.checkpoint is None:
        where = "the base model stays the best held-out evaluation: no checkpoint beat it"
    else:
        where = (
            f"the best held-out evaluation is eval/iter-{best.iteration:06d}, "
            f"checkpoints/iter-{best.checkpoint:06d}: `flowgrpo export {run.root} OUT --best` "
            "exports it"
        )
    on_note(
        f"stopped (eval.stop_on_drift) at eval/iter-{evaluated:06d}, after {updates(evaluated)}: "
        f"the held-out reward fell while the training reward rose; {where}. To go on, run "
        "again with --set eval.stop_on_drift=false"
    )


def _best_note(run: RunDir, on_note) -> None:
    """The loop's last line: the best held-out evaluation so far, when there is one."""
    best = best_evaluation(run)
    if best is not None and on_note is not None:
        from flowgrpo_cli.reporting.render import describe_best

        on_note(f"best held-out evaluation: {describe_best(best)}")


def score_failures(run: RunDir, iteration: int) -> str:
    """What the iteration's score manifest says about images a reward failed on: how many,
    what reward.on_error did with them, and the first error."""
    manifest = read_manifest(run.stage_dir(iteration, SCORE)) or {}
    counts = manifest.get("counts", {})
    errors = manifest.get("first_errors") or ["(not recorded)"]
    return (
        f"{counts.get('failed', '?')} of {counts.get('images', '?')} images failed scoring "
        f"(reward.on_error = {manifest.get('on_error', '?')}): first error: {errors[0]}"
    )


def _report_final_evaluation(run: RunDir, iterations: int, trackers, on_note) -> None:
    """The evaluation after the last iteration (of the base, for -n 0; or the one the loop
    stopped at on drift): no iteration's line carries it, so it is logged and shown here."""
    final = next((line for line in read_log(run) if line["iteration"] == iterations), {})
    evals = {k: v for k, v in final.items() if k.startswith("eval/")}
    if not evals:
        return
    track(trackers, run, {"iteration": iterations, **evals})
    if on_note is not None:
        from flowgrpo_cli.reporting.render import checkpoint_name, updates

        where = f"eval/iter-{iterations:06d}"
        what = (
            "the base model"
            if iterations == 0
            else f"the policy after {updates(iterations)} "
            f"({checkpoint_name(iterations - 1)}, {where})"
        )
        shown = sorted((k for k in evals if k.endswith(("_mean", "_exact"))),
                       key=lambda k: (k != "eval/reward_mean", k))  # fmt: skip
        on_note(f"held-out evaluation of {what}: "
                + ", ".join(f"{k} {evals[k]:.4g}" for k in shown))  # fmt: skip


def plan_note(config: Config, iterations: int) -> list[str]:
    """`flowgrpo plan`'s summary of this run: memory per device, disk per iteration and for
    the run. Never stops the run: a plan that cannot be made is one line saying why."""
    try:
        from flowgrpo_cli.planning import plan_run

        return plan_run(config, iterations=max(iterations, 1)).summary_lines()
    except Exception as err:  # a plan is advice: the run goes on without it
        return [f"plan: not available ({type(err).__name__}: {err})"]


def _retention(config: Config) -> tuple[int, int, int]:
    section = config.run
    return section.keep_trajectories, section.keep_checkpoints, section.checkpoint_every


def _eval_due(config: Config, iteration: int, iterations: int) -> bool:
    """Evaluate the policy iteration `iteration` starts from: at the start, every k, the end."""
    every = config.eval.every
    return bool(every) and (iteration % every == 0 or iteration == iterations)


def write_logs(run: RunDir, last_iteration: int, config: Config) -> list[dict]:
    """Rewrite metrics.jsonl up to `last_iteration` (with the drift rule's `eval/drift` under
    eval.drift_window) and write the sample grids missing for the iterations before it;
    returns the log's lines.

    Both are derived from the stage folders, so writing them after each iteration and again on
    every start loses nothing to a kill at any point between.
    """
    for iteration in range(last_iteration):
        if not run.samples_path(iteration).is_file():
            write_iteration_grid(run, iteration)
    return rebuild(run, last_iteration, drift_window=config.eval.drift_window)


def write_iteration_grid(run: RunDir, iteration: int) -> None:
    """samples/iter-N.png: the first images of the first groups, with their rewards (an
    editing run's: a row per group, the source image its prompt edits first).

    The rollout and score parts are checked against their manifests first (a grid is rebuilt
    from them on every start; right after the update that read them, the check is a stat, see
    rundir.verify_part); a sample without a score is named, not a KeyError."""
    rollout_dir = run.stage_dir(iteration, ROLLOUT)
    scores_dir = run.stage_dir(iteration, SCORE)
    verify_stage(rollout_dir)
    verify_stage(scores_dir)
    trajectory_parts = RolloutManifest.read(rollout_dir).trajectory_parts
    score_parts = [scores_dir / p for p in ScoreManifest.read(scores_dir).parts]
    rewards = read_table(score_parts, ["sample_id", "reward"]).to_pydict()
    reward_of = dict(zip(rewards["sample_id"], rewards["reward"], strict=True))
    items: list[GridItem] = []
    per_group: dict[int, list[GridItem]] = {}  # the groups shown, in order
    prompt_of: dict[int, int] = {}  # group -> its prompt_index
    columns = ["sample_id", "group_id", "prompt_index", "prompt", "ground_truth", "image"]
    parts = [rollout_dir / p for p in trajectory_parts]
    for batch in iter_batches(parts, columns):
        for row in batch.to_pylist():
            group = row["group_id"]
            if len(per_group) >= GRID_GROUPS and group not in per_group:
                continue
            if len(per_group.get(group, [])) >= GRID_PER_GROUP:
                continue
            if row["sample_id"] not in reward_of:
                raise FlowGrpoError(
                    f"{', '.join(map(str, score_parts))}: no score for sample "
                    f"{row['sample_id']!r} of {rollout_dir}; delete {scores_dir} and run "
                    f"`flowgrpo score --iteration {iteration}` again"
                )
            reward = reward_of[row["sample_id"]]
            items.append(GridItem(row["image"], row["prompt"], row["ground_truth"], reward))
            per_group.setdefault(group, []).append(items[-1])
            prompt_of[group] = row["prompt_index"]
    sources = source_images(run, "train", prompt_of.values())  # {}: text-to-image
    cells: list[GridItem | None] = list(items)
    width = GRID_PER_GROUP
    if sources:  # an editing run: a row per group, its source image first
        rows = [(sources[prompt_of[group]], shown) for group, shown in per_group.items()]
        cells, width = edit_cells(rows, GRID_PER_GROUP), GRID_PER_GROUP + 1
    try:
        grid = make_grid(cells, columns=width)
    except UnidentifiedImageError as err:
        raise FlowGrpoError(f"{rollout_dir}: an image is not a readable PNG ({err})") from None
    atomic_write_bytes(run.samples_path(iteration), grid)
