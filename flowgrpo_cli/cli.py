"""The `flowgrpo` command line: parse, resolve the run's config, call a stage, render.

Kept thin and light: heavy libraries (torch, diffusers, pyarrow) are imported inside the
commands, so `flowgrpo --help` answers at once. A FlowGrpoError becomes a one-line message
and exit code 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from flowgrpo_cli.errors import FlowGrpoError, storage_error
from flowgrpo_cli.reporting.render import (
    render_iteration,
    render_loop_progress,
    render_metrics,
    render_prepare_summary,
    render_reward_table,
    render_scores,
)

app = typer.Typer(
    name="flowgrpo",
    help="Flow-GRPO reinforcement learning for flow-matching text-to-image models.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from flowgrpo_cli import __version__

        console.print(f"flowgrpo {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Flow-GRPO reinforcement learning for flow-matching text-to-image models."""


F = TypeVar("F", bound=Callable[..., Any])

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Run config (TOML); default: the run's own config.toml, else built-in defaults.",
    ),
]
RunOpt = Annotated[
    Path | None,
    typer.Option(
        "--run",
        "--run-dir",
        "-r",
        help="Run directory (overrides run.dir). Under torchrun write --run-dir or -r: "
        "torchrun's own parser reads --run as its --run-path.",
    ),
]


def _complete_set_key(incomplete: str) -> list[str]:
    """Shell completion of --set: every config key, as `KEY=`."""
    from flowgrpo_cli.store.config import iter_reference

    return [f"{key}=" for key, _, _ in iter_reference() if key.startswith(incomplete)]


SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a config key: --set sampler.noise_level=0.8 (repeatable).",
        autocompletion=_complete_set_key,
    ),
]
AllowChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-config-change", help="Replace the run's stored config when this one differs."
    ),
]


# True while `run_in_rank` runs a command: a user error then propagates to the Ray launcher.
_RAISE_USER_ERRORS = contextvars.ContextVar("flowgrpo_raise_user_errors", default=False)


def user_errors(fn: F) -> F:
    """Turn FlowGrpoError, and an OS error the user fixes (full or read-only disk,
    permissions), into a clean message and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return fn(*args, **kwargs)
            except OSError as err:  # disk full, read-only, permissions: the user's to fix
                storage = storage_error(err)
                if storage is None:
                    raise
                raise storage from None
        except _QuietExit:
            raise typer.Exit(1) from None
        except FlowGrpoError as err:
            if _RAISE_USER_ERRORS.get():
                raise
            from flowgrpo_cli.launch.rank_errors import record_rank_error

            if record_rank_error(str(err)):  # the launching process prints it, once
                raise typer.Exit(1) from None
            err_console.print(
                f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def run_in_rank(argv: list[str]) -> None:
    """Run `flowgrpo ARGV` in this process as one rank of a Ray launch (ray_cluster.py).

    A FlowGrpoError is raised rather than printed: Ray hands it to the launching process,
    which reports it with the rank's number.
    """
    token = _RAISE_USER_ERRORS.set(True)
    try:
        code = app(list(argv), standalone_mode=False, prog_name="flowgrpo")
    finally:
        _RAISE_USER_ERRORS.reset(token)
    if code:
        raise FlowGrpoError(f"`flowgrpo {' '.join(argv)}` exited with code {code}")


@app.command()
@user_errors
def prepare(
    config: ConfigOpt = None,
    run: RunOpt = None,
    set_: SetOpt = None,
    allow_config_change: AllowChangeOpt = False,
    train: Annotated[Path | None, typer.Option(help="Training prompts (sets data.train).")] = None,
    test: Annotated[Path | None, typer.Option(help="Test prompts (sets data.test).")] = None,
    test_fraction: Annotated[
        float | None,
        typer.Option(help="Share held out when no test file is given (sets data.test_fraction)."),
    ] = None,
    negative_prompt: Annotated[
        str | None,
        typer.Option(help="Negative prompt for rows lacking one (sets data.negative_prompt)."),
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option(help="System prompt, Qwen-Image (sets data.system_prompt).")
    ] = None,
    skip_invalid: Annotated[
        bool, typer.Option("--skip-invalid", help="Skip invalid rows and report how many.")
    ] = False,
) -> None:
    """Prompt files (txt / jsonl / csv / parquet; an `image` column for editing) -> RUN/data/."""
    from flowgrpo_cli.stages import prepare as stage
    from flowgrpo_cli.store.runconfig import resolve_run

    options = {
        "data.train": train,
        "data.test": test,
        "data.test_fraction": test_fraction,
        "data.negative_prompt": negative_prompt,
        "data.system_prompt": system_prompt,
        "data.skip_invalid": True if skip_invalid else None,
    }
    overrides = [*(set_ or []), *_as_overrides(options)]
    resolved = resolve_run(config, overrides, run, allow_change=allow_config_change)
    with resolved.writing():
        result = stage.run(resolved.config, resolved.run)
    render_prepare_summary(console, resolved.run, result.manifest)
    if not result.fresh:
        console.print(
            f"{resolved.run.data_dir} was already prepared from the same prompts and config: "
            "left as it was",
            highlight=False,
            soft_wrap=True,
        )


NprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc",
        help="Ranks: processes on this host via torch.distributed's launcher, or Ray workers "
        "with --ray-address (sets distributed.nproc).",
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="Run the ranks on this Ray cluster: the head's HOST:PORT, or `auto` (as "
        'distributed.backend = "ray" with distributed.ray_address); --nproc = Ray workers.',
    ),
]
IterationOpt = Annotated[
    int | None,
    typer.Option(
        "--iteration",
        "-i",
        help="Iteration number; default: the run's current "
        "one (the first without a finished update).",
    ),
]


def _run_ranks(
    resolved: Any,
    nproc: int | None,
    body: Callable[[], None],
    ray_address: str | None = None,
    first: Callable[[], None] | None = None,
) -> None:
    """Run `body` in this process, or as `nproc` ranks re-launched through torchrun or placed
    by Ray (`--ray-address`, or distributed.backend = "ray").

    The launching process holds the run's lock while its ranks work, and runs `first` under
    it before any rank starts; ranks take no lock.
    """
    import sys

    from flowgrpo_cli.launch.distributed import (
        check_devices,
        is_rank_process,
        launch_local,
        launched_by_flowgrpo,
    )
    from flowgrpo_cli.ray_cluster import ray_address_for

    section = resolved.config.distributed
    ranks = nproc or section.nproc
    if is_rank_process():
        if launched_by_flowgrpo():
            body()
        else:
            _run_under_external_launcher(resolved, body, first)
        return
    address = ray_address_for(resolved.config, ray_address)
    if address is None:  # Ray places ranks on the cluster's GPUs, not this host's
        check_devices(resolved.config.model.device, ranks)
    with resolved.writing():
        if first is not None:
            first()
        if address is not None:
            from flowgrpo_cli.ray_cluster import launch_ray

            launch_ray(
                sys.argv[1:],
                run_in_rank,
                nproc=ranks,
                address=address,
                cpus_per_worker=section.cpus_per_worker,
                gpus_per_worker=section.gpus_per_worker,
                run_root=resolved.run.root,
            )
            return
        if ranks > 1:
            failed = launch_local(ranks, sys.argv[1:])
            if failed is not None:
                raise FlowGrpoError(_rank_errors(failed))
            return
        body()


def _rank_errors(failed: dict[int, str]) -> str:
    """One message for the ranks' errors: once when they agree, else each with its ranks."""
    if not failed:
        return "a rank failed (its traceback is above)"
    by_message: dict[str, list[int]] = {}
    for rank, message in sorted(failed.items()):
        by_message.setdefault(message, []).append(rank)
    if len(by_message) == 1:
        return next(iter(by_message))
    return "the ranks failed:\n" + "\n".join(
        f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
        for message, ranks in by_message.items()
    )


class _QuietExit(FlowGrpoError):
    """A rank stops because rank 0 failed; rank 0 says why."""


def _run_under_external_launcher(
    resolved: Any, body: Callable[[], None], first: Callable[[], None] | None
) -> None:
    """Ranks that torchrun (or any launcher but ours) started: rank 0 does what our own
    launching process does, holding the run's lock and storing the config (and `first`),
    while every rank runs `body`."""
    from flowgrpo_cli.launch.distributed import (
        broadcast_object,
        dist_info,
        init_process_group,
        resolve_device,
    )

    init_process_group(resolve_device(resolved.config.model.device))
    if not dist_info().is_main:
        if not broadcast_object(None):
            raise _QuietExit("rank 0 failed before the work began")
        body()
        return
    started = False
    try:
        with resolved.writing():
            if first is not None:
                first()
            started = True
            broadcast_object(True)
            body()
    finally:
        if not started:
            broadcast_object(False)


def _iteration_of(resolved: Any, iteration: int | None) -> int:
    """The iteration a stage command works on: --iteration, else the run's current one."""
    return resolved.run.current_iteration() if iteration is None else iteration


def _load_policy_for(resolved: Any, iteration: int, *, sampling: bool = False) -> Any:
    """The policy iteration `iteration` starts from; with `sampling`, the weights its rollout
    samples with (nft: the checkpoint's anchor)."""
    from flowgrpo_cli.launch.distributed import init_process_group, resolve_device
    from flowgrpo_cli.training.algorithms import algorithm_for
    from flowgrpo_cli.training.policy import (
        ANCHOR_FOLDER,
        checkpoint_for,
        load_policy,
        load_weights,
    )

    device = resolve_device(resolved.config.model.device)
    init_process_group(device)
    policy = load_policy(resolved.config, device)
    checkpoint = checkpoint_for(resolved.run, iteration)
    if checkpoint is not None:
        anchor = sampling and algorithm_for(resolved.config).samples_with_anchor
        load_weights(policy, checkpoint, ANCHOR_FOLDER if anchor else "")
    return policy


def _is_main() -> bool:
    from flowgrpo_cli.launch.distributed import dist_info

    return dist_info().is_main


@app.command("tiny-model")
@user_errors
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder to write the pipeline to.")],
    family: Annotated[
        str,
        typer.Option(
            help="sd3, sd35, flux, flux-schnell, qwenimage, qwenimage_edit or flux_kontext."
        ),
    ] = "sd3",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Build a tiny random pipeline of a family, offline, and save it (for tests and demos)."""
    from flowgrpo_cli.models.tiny import build_tiny_pipeline

    if out.exists() and not out.is_dir():
        raise FlowGrpoError(f"{out} exists and is not a folder: choose a folder for the pipeline")
    path = build_tiny_pipeline(family, out, seed=seed)
    console.print(f"tiny {family} pipeline -> {path}")


def _stage_command(
    body: Callable[[Any, int], None],
    instead: Callable[[Any, int | None, str | None], bool] | None = None,
) -> Callable[..., None]:
    """A stage command: the options every stage shares, the run they resolve to, then
    `body(resolved, iteration)` on every rank (this process, local ranks or Ray workers).
    `instead` may take the command over first (score on a Ray task pool) by returning True."""

    def command(
        config: ConfigOpt = None,
        run: RunOpt = None,
        set_: SetOpt = None,
        allow_config_change: AllowChangeOpt = False,
        iteration: IterationOpt = None,
        nproc: NprocOpt = None,
        ray_address: RayAddressOpt = None,
    ) -> None:
        from flowgrpo_cli.store.runconfig import resolve_run

        resolved = resolve_run(config, set_ or [], run, allow_change=allow_config_change)
        if instead is not None and instead(resolved, iteration, ray_address):
            return
        _run_ranks(
            resolved, nproc, lambda: body(resolved, _iteration_of(resolved, iteration)), ray_address
        )

    command.__doc__ = body.__doc__
    return user_errors(command)


def _rollout(resolved: Any, number: int) -> None:
    """Sample groups of images with per-step log-probs -> RUN/iter-N/rollout/."""
    from flowgrpo_cli.engines import build_engine, engine_class
    from flowgrpo_cli.reporting.progress import NullProgress, RichProgress
    from flowgrpo_cli.stages import rollout as stage
    from flowgrpo_cli.store.rundir import ROLLOUT

    cfg = resolved.config
    engine_class(cfg.sampler.engine)  # fails fast on a missing engine
    policy = _load_policy_for(resolved, number, sampling=True)
    engine = build_engine(cfg, policy)
    progress = RichProgress() if _is_main() else NullProgress()
    result = stage.run(cfg, resolved.run, number, engine, progress)
    if _is_main():
        folder = resolved.run.stage_dir(number, ROLLOUT)
        console.print(
            f"rollout iteration {number}: {result.manifest['counts']['images']} images -> {folder}",
            highlight=False,
        )


def _score(resolved: Any, number: int) -> None:
    """Score an iteration's images with the configured rewards -> RUN/iter-N/scores/."""
    from flowgrpo_cli.launch.distributed import init_process_group, resolve_device
    from flowgrpo_cli.reporting.progress import NullProgress, RichProgress
    from flowgrpo_cli.stages import score as stage

    init_process_group(resolve_device("cpu"))
    progress = RichProgress() if _is_main() else NullProgress()
    result = stage.run(resolved.config, resolved.run, number, progress=progress)
    if _is_main():
        render_scores(console, result.manifest)


def _score_on_ray_pool(resolved: Any, iteration: int | None, ray_address: str | None) -> bool:
    """Score as Ray tasks apart from the ranks, when the Ray backend is on and
    distributed.score_tasks > 0; False when that is not asked for."""
    from flowgrpo_cli.launch.distributed import is_rank_process
    from flowgrpo_cli.ray_cluster import ray_address_for, score_on_pool

    address = ray_address_for(resolved.config, ray_address)
    if address is None or resolved.config.distributed.score_tasks <= 0 or is_rank_process():
        return False
    from flowgrpo_cli.reporting.progress import RichProgress

    with resolved.writing():
        number = _iteration_of(resolved, iteration)
        result = score_on_pool(
            resolved.config, resolved.run, number, address=address, progress=RichProgress()
        )
    render_scores(console, result.manifest)
    return True


def _update(resolved: Any, number: int) -> None:
    """Advantages + clipped policy-gradient step -> RUN/iter-N/update/ and a checkpoint."""
    from flowgrpo_cli.reporting.progress import NullProgress, RichProgress
    from flowgrpo_cli.stages import update as stage
    from flowgrpo_cli.training.trainer import Trainer

    policy = _load_policy_for(resolved, number)
    trainer = Trainer(resolved.config, policy)
    if number > 0:
        trainer.load(resolved.run.checkpoint_dir(number - 1))
    progress = RichProgress() if _is_main() else NullProgress()
    result = stage.run(resolved.config, resolved.run, number, trainer, progress)
    if _is_main():
        from flowgrpo_cli.store.retention import apply_retention

        section = resolved.config.run
        apply_retention(
            resolved.run, section.keep_trajectories, section.keep_checkpoints,
            section.checkpoint_every,
        )  # fmt: skip
        render_metrics(console, f"update iteration {number}", result.metrics)


app.command("rollout")(_stage_command(_rollout))
app.command("score")(_stage_command(_score, instead=_score_on_ray_pool))
app.command("update")(_stage_command(_update))


@app.command()
@user_errors
def evaluate(
    config: ConfigOpt = None,
    run: RunOpt = None,
    set_: SetOpt = None,
    allow_config_change: AllowChangeOpt = False,
    iteration: Annotated[
        int | None,
        typer.Option(
            "--iteration",
            "-i",
            help="Checkpoint to evaluate (checkpoints/iter-N, the policy after N+1 updates, "
            "written to eval/iter-(N+1)); default: the latest finished one.",
        ),
    ] = None,
    base: Annotated[
        bool,
        typer.Option(
            "--base",
            help="Evaluate the model the run starts from, no trained weights (model.path, "
            "with model.init_lora if set) -> eval/iter-000000.",
        ),
    ] = False,
    nproc: NprocOpt = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Score a checkpoint (or --base) on the run's held-out prompts, as the loop's evaluation
    does -> RUN/eval/iter-M/ and samples/eval-iter-M.png."""
    from flowgrpo_cli.stages import evaluate as stage
    from flowgrpo_cli.store.runconfig import resolve_run

    if base and iteration is not None:
        raise FlowGrpoError(
            f"--base and --iteration {iteration} name two policies: give one (--base: the "
            "model before any update; --iteration N: checkpoints/iter-N)"
        )
    resolved = resolve_run(config, set_ or [], run, allow_change=allow_config_change)
    evaluated = stage.evaluated_iteration(resolved.config, resolved.run, iteration, base)
    _run_ranks(resolved, nproc, lambda: _evaluate(resolved, evaluated), ray_address)


def _evaluate(resolved: Any, evaluated: int) -> None:
    """The loop's evaluation of the policy after `evaluated` updates, with the weights the loop
    evaluates: the EMA (from the checkpoint, through the trainer as the loop holds it) when
    train.ema_decay > 0, else the checkpoint's weights."""
    import contextlib

    from flowgrpo_cli.engines import build_engine, engine_class
    from flowgrpo_cli.reporting.progress import NullProgress, RichProgress
    from flowgrpo_cli.reporting.render import checkpoint_name, updates
    from flowgrpo_cli.stages import evaluate as stage
    from flowgrpo_cli.store.evaluations import write_best
    from flowgrpo_cli.store.metrics_log import rebuild

    cfg = resolved.config
    engine_class(cfg.sampler.engine)  # fails fast on a missing engine
    policy = _load_policy_for(resolved, evaluated)
    weights: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if cfg.train.ema_decay > 0:
        from flowgrpo_cli.training.trainer import Trainer

        trainer = Trainer(cfg, policy)
        if evaluated > 0:
            trainer.load(resolved.run.checkpoint_dir(evaluated - 1))
        weights = trainer.ema_weights()
    engine = build_engine(cfg, policy)
    progress = RichProgress() if _is_main() else NullProgress()
    with weights:
        result = stage.run(cfg, resolved.run, evaluated, engine, progress=progress)
    if not _is_main():
        return
    # `flowgrpo report` reads the log; a new evaluation may be the best
    rebuild(resolved.run, resolved.run.current_iteration(), drift_window=cfg.eval.drift_window)
    write_best(resolved.run)
    if evaluated == 0:
        what = "the base model" + (" (model.init_lora)" if cfg.model.init_lora else "")
    else:
        what = f"{checkpoint_name(evaluated - 1)} (the policy after {updates(evaluated)})"
    kind = ", its EMA weights" if cfg.train.ema_decay > 0 and evaluated > 0 else ""
    folder = resolved.run.eval_dir(evaluated)
    console.print(
        f"held-out evaluation of {what}{kind} -> {folder}", highlight=False, soft_wrap=True
    )
    render_metrics(console, f"eval/{folder.name}", result.metrics)
    if not result.fresh:
        console.print(
            f"{folder} was already evaluated with the same config and weights: not recomputed",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
@user_errors
def loop(
    iterations: Annotated[
        int,
        typer.Option(
            "--iterations",
            "-n",
            help="Train until this many iterations are done; 0 only evaluates the base model "
            "(with eval.every > 0).",
        ),
    ],
    config: ConfigOpt = None,
    run: RunOpt = None,
    set_: SetOpt = None,
    allow_config_change: AllowChangeOpt = False,
    nproc: NprocOpt = None,
    ray_address: RayAddressOpt = None,
    restart_from: Annotated[
        int | None,
        typer.Option(
            "--restart-from",
            help="First delete iteration N and every later one (stages, checkpoints, "
            "evaluations, grids), then train from checkpoint N-1: redo them, e.g. with a "
            "changed config.",
        ),
    ] = None,
) -> None:
    """Rollout -> score -> update, iteration after iteration; a re-run resumes."""
    from flowgrpo_cli.store.runconfig import resolve_run

    if iterations < 0:
        raise FlowGrpoError(f"--iterations {iterations}: must be at least 0")
    resolved = resolve_run(config, set_ or [], run, allow_change=allow_config_change)
    if iterations == 0 and resolved.config.eval.every <= 0:
        raise FlowGrpoError(
            "--iterations 0 evaluates the base model only, and evaluation is off "
            "(eval.every = 0): set eval.every, e.g. --set eval.every=1"
        )

    def body() -> None:
        from flowgrpo_cli.loop import run_loop
        from flowgrpo_cli.reporting.progress import NullProgress, RichProgress

        main = _is_main()
        done = resolved.run.current_iteration()
        seconds: list[float] = []  # this process's iterations: the ETA's mean

        def on_iteration(summary: Any) -> None:
            render_iteration(console, summary)
            seconds.append(summary.seconds)
            render_loop_progress(console, summary.iteration + 1, iterations, seconds)

        if main and done >= iterations > 0:
            console.print(f"{resolved.run.root}: {done} iteration(s) already done")
        run_loop(
            resolved.config,
            resolved.run,
            iterations,
            progress=RichProgress() if main else NullProgress(),
            on_iteration=on_iteration if main else None,
            on_note=lambda text: console.print(text, highlight=False),
        )

    def drop() -> None:
        from flowgrpo_cli.store.retention import drop_iterations

        if restart_from is not None:
            drop_iterations(resolved.run, restart_from)

    _run_ranks(resolved, nproc, body, ray_address, first=drop)


RewardOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--reward",
        help="Reward (repeatable; NAME or NAME=WEIGHT, a built-in or module:function); "
        "default: the config's \\[reward] weights (ocr without a config).",
    ),
]
RewardConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Run config (TOML) whose \\[reward] tables set the rewards: models, device, "
        "dtype, OCR workers, remote URL, plugin folders, and weights without --reward.",
    ),
]
OcrWorkersOpt = Annotated[
    int | None, typer.Option(help="OCR worker processes (default: the config's, else 1).")
]


@app.command()
@user_errors
def reward(
    images: Annotated[list[Path], typer.Argument(help="Image files to score.")],
    prompt: Annotated[
        list[str] | None,
        typer.Option(
            help="The prompt (its quoted text is the OCR target); one for all images, or one per "
            "image. Default: the --geneval records' prompts."
        ),
    ] = None,
    geneval: Annotated[
        Path | None,
        typer.Option(
            help="GenEval metadata (jsonl): the record of each image, or one for all, for the "
            "`geneval` reward."
        ),
    ] = None,
    source: Annotated[
        list[Path] | None,
        typer.Option(
            help="The source image the images were edited from, for rewards that read one "
            "(source_similarity, vlm with_source_image): one for all images, or one per image."
        ),
    ] = None,
    reward_: RewardOpt = None,
    config: RewardConfigOpt = None,
    set_: SetOpt = None,
    ocr_workers: OcrWorkersOpt = None,
    url: Annotated[str | None, typer.Option(help="URL of the `remote` reward.")] = None,
) -> None:
    """Score image files against a prompt: check a reward before training on it."""
    from flowgrpo_cli.rewards import score_image_files
    from flowgrpo_cli.rewards.commands import read_geneval_records

    section = _reward_section(config, set_, reward_, ocr_workers, url=url)
    records = read_geneval_records(geneval) if geneval else None
    if not prompt and records is None:
        raise FlowGrpoError("give the images' prompt: --prompt TEXT (or --geneval RECORDS.jsonl)")
    if records is not None and len(records) == 1:
        records = records * len(images)
    if not prompt:
        assert records is not None
        prompt = [record["prompt"] for record in records]
    prompts = prompt * len(images) if len(prompt) == 1 else prompt
    sources = source * len(images) if source and len(source) == 1 else source
    result = score_image_files(images, prompts, section, records, sources)
    render_reward_table(console, images, result)


@app.command("serve-reward")
@user_errors
def serve_reward(
    reward_: RewardOpt = None,
    config: RewardConfigOpt = None,
    set_: SetOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one (printed).")] = 8000,
    ocr_workers: OcrWorkersOpt = None,
    plugin_dir: Annotated[
        list[Path] | None,
        typer.Option("--plugin-dir", help="Folder searched for plugins (repeatable)."),
    ] = None,
    max_batch: Annotated[
        int,
        typer.Option(
            help="Most images scored together: requests that wait while a batch is scored "
            "are merged up to this many."
        ),
    ] = 64,
    max_request_mb: Annotated[
        float, typer.Option(help="Largest request body in MB; a larger one gets HTTP 413.")
    ] = 128.0,
    max_image_pixels: Annotated[
        int,
        typer.Option(
            help="Most pixels (width x height) of one image, read from its header "
            "before it is decoded; more gets HTTP 400."
        ),
    ] = 2048 * 2048,
    max_images: Annotated[
        int, typer.Option(help="Most images in one request; more gets HTTP 400.")
    ] = 64,
    max_json_depth: Annotated[
        int, typer.Option(help="Deepest nesting of JSON arrays and objects in a request.")
    ] = 32,
) -> None:
    """Serve rewards over HTTP in the `remote` reward's wire format: POST /score, GET /health.
    The reply is the weighted total of the rewards."""
    from flowgrpo_cli.rewards import build_rewards_from_config
    from flowgrpo_cli.rewards.server import Limits, serve

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise FlowGrpoError(
            "serve-reward needs the `serve` extra: pip install 'flowgrpo[serve]'"
        ) from None
    if max_batch < 1:
        raise FlowGrpoError(f"--max-batch {max_batch}: must be >= 1")
    if not 0 <= port <= 65535:
        raise FlowGrpoError(f"--port {port}: must be in 0..65535 (0 picks a free one)")
    limits = Limits(max_request_mb, max_image_pixels, max_images, max_json_depth)
    section = _reward_section(config, set_, reward_, ocr_workers, plugin_dirs=plugin_dir)
    with build_rewards_from_config(section) as rewards:
        serve(
            rewards, host, port,
            on_ready=lambda url: print(
                f"serving {', '.join(section.weights)} at {url}", flush=True
            ),
            max_images=max_batch,
            limits=limits,
        )  # fmt: skip


def _reward_section(
    config: Path | None,
    overrides: list[str] | None,
    rewards: list[str] | None,
    ocr_workers: int | None,
    *,
    url: str | None = None,
    plugin_dirs: list[Path] | None = None,
):
    """The config's [reward] table with the command line's rewards and options on top."""
    import dataclasses

    from flowgrpo_cli.store.config import load_config

    section = load_config(config, overrides or []).reward
    changes: dict[str, Any] = {}
    if rewards:
        changes["weights"] = _reward_weights(rewards)
    if ocr_workers is not None:
        if ocr_workers < 1:
            raise FlowGrpoError(f"--ocr-workers {ocr_workers}: must be >= 1")
        changes["ocr_workers"] = ocr_workers
    if url:
        changes["remote"] = dataclasses.replace(section.remote, url=url)
    if plugin_dirs:
        changes["plugin_dirs"] = [
            *(str(folder.absolute()) for folder in plugin_dirs),
            *section.plugin_dirs,
        ]
    return dataclasses.replace(section, **changes)


def _reward_weights(items: list[str]) -> dict[str, float]:
    weights = {}
    for item in items:
        name, _, weight = item.partition("=")
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise FlowGrpoError(f"--reward {item}: the weight {weight!r} is not a number") from None
    return weights


@app.command()
@user_errors
def report(
    run: Annotated[Path, typer.Argument(help="The run directory.")],
) -> None:
    """Write RUN/report/index.html (self-contained) and PNG plots from the run's metrics."""
    from flowgrpo_cli.reporting.render import describe_best
    from flowgrpo_cli.reporting.report import best_in_log, write_report
    from flowgrpo_cli.store.metrics_log import read_log
    from flowgrpo_cli.store.rundir import RunDir

    if not run.is_dir():
        raise FlowGrpoError(f"{run} is not a run directory")
    console.print(f"report -> {write_report(RunDir(run))}")
    best = best_in_log(read_log(RunDir(run)))
    if best is not None:
        console.print(f"best held-out evaluation: {describe_best(best)}", highlight=False)


@app.command()
@user_errors
def export(
    run: Annotated[Path, typer.Argument(help="The run directory.")],
    out: Annotated[Path, typer.Argument(help="New folder to write the export to.")],
    iteration: Annotated[
        int | None,
        typer.Option(
            "--iteration", "-i", help="Checkpoint to export (checkpoints/iter-N); default: latest."
        ),
    ] = None,
    best: Annotated[
        bool,
        typer.Option(
            "--best",
            help="The checkpoint of the best held-out evaluation (highest eval/reward_mean; "
            "best.json), as --iteration would name it.",
        ),
    ] = False,
    ema: Annotated[
        bool, typer.Option("--ema", help="The EMA weights (train.ema_decay > 0) instead.")
    ] = False,
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="A whole pipeline folder with the LoRA fused in (full fine-tuning always is).",
        ),
    ] = False,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Precision of a merged pipeline: float32, bfloat16 or float16; "
            "default model.dtype."
        ),
    ] = None,
    push_to_hub: Annotated[
        str | None,
        typer.Option("--push-to-hub", help="Then upload the folder to this Hub repo (USER/NAME)."),
    ] = None,
    private: Annotated[
        bool, typer.Option("--private", help="With --push-to-hub: create the repo private.")
    ] = False,
) -> None:
    """A checkpoint as a LoRA folder diffusers loads, or a merged pipeline, with a model card."""
    import shlex

    from flowgrpo_cli.export import export_checkpoint
    from flowgrpo_cli.export import push_to_hub as upload
    from flowgrpo_cli.store.runconfig import resolve_run

    if not (run / "config.toml").is_file():
        raise FlowGrpoError(f"{run} is not a run directory (it has no config.toml)")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise FlowGrpoError(f"--dtype {dtype}: choose float32, bfloat16 or float16")
    resolved = resolve_run(None, [], run, write=False)
    if best:
        iteration = _best_checkpoint(resolved, iteration)
    # The card records --iteration N, the checkpoint --best named now: the best may change.
    options = {"--iteration": iteration, "--ema": ema, "--merged": merged, "--dtype": dtype}
    command = ["flowgrpo", "export", str(run), str(out)]
    for flag, value in options.items():
        if value is True:
            command.append(flag)
        elif value not in (None, False):
            command += [flag, str(value)]
    # No lock: a finished checkpoint is never rewritten, so a run can be exported while it
    # trains (the copy is checked against the checkpoint's manifest).
    done = export_checkpoint(
        resolved.config, resolved.run, out, iteration=iteration, ema=ema, merged=merged,
        dtype=dtype, command=shlex.join(command),
    )  # fmt: skip
    from flowgrpo_cli.reporting.render import checkpoint_name, updates

    kind = "pipeline" if done.merged else "LoRA"
    console.print(
        f"{kind} of {checkpoint_name(done.iteration)} (the policy after "
        f"{updates(done.iteration + 1)}), {done.weights} weights -> {done.folder}",
        highlight=False,
    )
    if best and resolved.config.train.ema_decay > 0 and not ema:
        console.print(
            "note: the evaluations measured this checkpoint's EMA weights (train.ema_decay > 0): "
            "add --ema to export the weights that were evaluated",
            highlight=False,
        )
    if push_to_hub:
        console.print(f"uploaded -> {upload(done.folder, push_to_hub, private=private)}")


def _best_checkpoint(resolved: Any, iteration: int | None) -> int:
    """The checkpoint `export --best` names: the best held-out evaluation's."""
    from flowgrpo_cli.reporting.render import describe_best
    from flowgrpo_cli.store.evaluations import best_evaluation

    if iteration is not None:
        raise FlowGrpoError(
            f"--best and --iteration {iteration} name two checkpoints: give one (--best: the "
            "best held-out evaluation's; --iteration N: checkpoints/iter-N)"
        )
    run = resolved.run
    found = best_evaluation(run)
    if found is None:
        raise FlowGrpoError(
            f"--best: {run.root} has no held-out evaluation yet (no finished eval/iter-N with "
            "eval/reward_mean): train with eval.every > 0 (`flowgrpo loop`), or evaluate a "
            "checkpoint with `flowgrpo evaluate`; --iteration N exports a checkpoint by number"
        )
    if found.checkpoint is None:
        raise FlowGrpoError(
            f"--best: the best held-out evaluation is the base model's ({describe_best(found)}): "
            "no trained checkpoint to export; --iteration N exports one anyway"
        )
    console.print(f"best held-out evaluation: {describe_best(found)}", highlight=False)
    return found.checkpoint


@app.command()
@user_errors
def inspect(
    path: Annotated[
        Path, typer.Argument(help="A run, an iteration folder, a stage folder or one part file.")
    ],
    images: Annotated[
        Path | None,
        typer.Option(help="Write each image as PNG into this folder, with prompts.tsv."),
    ] = None,
) -> None:
    """Describe what a run, iteration, stage or part holds: schema, counts, groups, log-probs."""
    from flowgrpo_cli.reporting.inspection import describe

    describe(console, path, images_dir=images)


@app.command("config")
@user_errors
def show_config(
    config: ConfigOpt = None,
    run: RunOpt = None,
    set_: SetOpt = None,
    reference: Annotated[
        bool, typer.Option("--reference", help="List every key with its default and meaning.")
    ] = False,
) -> None:
    """Print the resolved config (validated), or the reference of every key."""
    from flowgrpo_cli.store.config import dumps_config, iter_reference
    from flowgrpo_cli.store.runconfig import resolve_run

    if reference:
        for key, default, meaning in iter_reference():
            console.print(
                f"[bold]{key}[/] = {escape(default)}\n    {escape(meaning)}",
                highlight=False,
                soft_wrap=True,
            )
        return
    resolved = resolve_run(config, set_ or [], run, write=False)
    # soft_wrap: long lines stay whole, so `flowgrpo config > my.toml` is valid TOML
    console.print(dumps_config(resolved.config), highlight=False, markup=False, soft_wrap=True)


@app.command()
@user_errors
def plan(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    iterations: Annotated[
        int, typer.Option("--iterations", "-n", help="Iterations the disk total counts.")
    ] = 1000,
    arch: Annotated[
        str | None,
        typer.Option(
            help="Architecture to plan instead of model.path's: sd3.5-medium, flux.1-dev, "
            "flux.1-schnell, flux.1-kontext-dev, qwen-image, or a local diffusers folder."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Memory per device of each stage, disk per iteration and for the run, transformer
    passes: before anything is loaded or downloaded (no weights, no network, no run dir)."""
    import json

    from flowgrpo_cli.planning import plan_run
    from flowgrpo_cli.planning.table import render_plan
    from flowgrpo_cli.store.config import load_config

    if iterations < 1:
        raise FlowGrpoError(f"--iterations {iterations}: must be at least 1")
    made = plan_run(load_config(config, set_ or []), iterations=iterations, arch=arch)
    if as_json:
        typer.echo(json.dumps(made.to_dict(), indent=1))
    else:
        render_plan(console, made)


def _as_overrides(options: dict[str, Any]) -> list[str]:
    """Dedicated CLI options become `--set` overrides, quoted as TOML values."""
    import json

    out = []
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        out.append(f"{key}={text}")
    return out


def main() -> None:
    app()
