"""Experiment trackers (`log.trackers`): TensorBoard, Weights & Biases, trackio.

The loop hands every tracker the same things once each iteration is finished: its line of
metrics.jsonl (step = the iteration), its sample grid and, when one was made, the evaluation
grid; at the start, the run's config as hyperparameters. metrics.jsonl stays the record every
tracker is fed from, so a tracker missing a step (a crash between the two) loses nothing a
report or a re-run needs. Each tracker is an optional extra; naming one that is not installed
is an error that names the extra, before any work.

- tensorboard: event files in RUN/tensorboard (scalars, grids as images, the config in the
  HPARAMS tab).
- wandb: a W&B run in RUN/wandb, project `log.project`, its id derived from the run folder so
  a resumed loop continues it; WANDB_MODE=offline keeps it local (`wandb sync` later).
- trackio: local-first (a SQLite file under TRACKIO_DIR, by default
  ~/.cache/huggingface/trackio; `trackio show` opens the dashboard), same project and name.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, cast

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.config import Config, to_dict
from flowgrpo_cli.store.rundir import RunDir

GRID_WIDTH = 512  # px: TensorBoard stores each grid in its event file


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float], images: dict[str, Path]) -> None: ...

    def close(self) -> None: ...


# (run, project, name, hyperparameters) -> an open tracker.
_Builder = Callable[[RunDir, str, str, dict[str, Any]], Tracker]


def hyperparameters(config: Config) -> dict[str, Any]:
    """The config as flat `section.key` values; lists and tables as JSON text."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and not prefix.endswith("weights"):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        elif isinstance(value, list | dict):
            flat[prefix] = json.dumps(value, sort_keys=True)
        else:
            flat[prefix] = value

    walk("", to_dict(config))
    return flat


def active_trackers(names: list[str]) -> list[str]:
    """The trackers to open: TensorBoard only when installed (the default list names it); a
    missing wandb or trackio is an error that names its extra."""
    active = []
    for name in names:
        try:
            __import__("torch.utils.tensorboard" if name == "tensorboard" else name)
        except ImportError:
            if name == "tensorboard":
                continue
            raise FlowGrpoError(
                f"log.trackers names {name!r}, which is not installed: pip install "
                f"'flowgrpo[{name}]' (or take it out of log.trackers)"
            ) from None
        if name == "wandb":
            _check_wandb_login()
        active.append(name)
    return active


_WANDB_LOGIN = (
    "log.trackers names 'wandb', but no W&B API key is configured{why}: run `wandb login`, "
    "set WANDB_API_KEY, or set WANDB_MODE=offline to keep the run local (`wandb sync` later)"
)


def _check_wandb_login() -> None:
    """Refuse W&B without credentials before any work, rather than fail (or wait for a typed
    key) in wandb.init once the model is loaded. Offline and disabled modes need none."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_API_KEY", "").strip():
        return
    try:  # wandb's own lookup: environment, ~/.netrc, its settings file
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:  # another wandb: its init says what is missing (see _wandb)
        return
    host = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    try:
        found = authenticate_session(
            host=host, source="flowgrpo", prompt=False, update_session=False
        )
    except AuthenticationError as err:
        raise FlowGrpoError(_WANDB_LOGIN.format(why=f" ({err})")) from None
    if found is None:
        raise FlowGrpoError(_WANDB_LOGIN.format(why=f" for {host}"))


@contextmanager
def open_trackers(config: Config, run: RunDir, names: list[str]) -> Iterator[list[Tracker]]:
    """The trackers `names` (from active_trackers), given the config, closed on the way out."""
    name = config.log.name or run.root.name
    params = hyperparameters(config)
    builders: dict[str, _Builder] = {
        "tensorboard": _TensorBoard,
        "wandb": _wandb,
        "trackio": _trackio,
    }
    trackers: list[Tracker] = []
    try:
        for kind in names:
            trackers.append(builders[kind](run, config.log.project, name, params))
        yield trackers
    finally:
        for tracker in trackers:
            tracker.close()


def track(trackers: list[Tracker], run: RunDir, line: dict[str, Any]) -> None:
    """One line of metrics.jsonl to every tracker, with the grids of its iteration."""
    step = line["iteration"]
    metrics = {k: v for k, v in line.items() if k != "iteration" and isinstance(v, int | float)}
    grids = {"samples/train": run.samples_path(step), "samples/eval": run.eval_samples_path(step)}
    images = {key: path for key, path in grids.items() if path.is_file()}
    for tracker in trackers:
        tracker.log(step, metrics, images)


class _TensorBoard:
    def __init__(self, run: RunDir, project: str, name: str, params: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        from torch.utils.tensorboard.writer import FileWriter

        self._writer = SummaryWriter(log_dir=str(run.root / "tensorboard"))
        # The HPARAMS tab, in this run's own event file (add_hparams would start another run).
        shown = {k: v for k, v in params.items() if isinstance(v, int | float | str | bool)}
        # Opened by SummaryWriter.__init__ (torch declares the attribute as None).
        file_writer = cast(FileWriter, self._writer.file_writer)
        for summary in hparams(shown, {"eval/reward_mean": 0.0}):
            file_writer.add_summary(summary)

    def log(self, step: int, metrics: dict[str, float], images: dict[str, Path]) -> None:
        import numpy as np
        from PIL import Image

        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        for key, path in images.items():
            with Image.open(path) as image:
                small = image.convert("RGB")
            small.thumbnail((GRID_WIDTH, GRID_WIDTH * 4))
            pixels = np.asarray(small)
            self._writer.add_image(key, pixels, global_step=step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _HostedRun:
    """W&B and trackio, which share their calls: init, Image, Run.log(step=), Run.finish."""

    # `module` is wandb or trackio; `init` goes to its init() as keywords.
    def __init__(self, module: ModuleType, **init: object):
        self._module = module
        self._run = module.init(**init)

    def log(self, step: int, metrics: dict[str, float], images: dict[str, Path]) -> None:
        media = {key: self._module.Image(str(path)) for key, path in images.items()}
        self._run.log({**metrics, **media}, step=step)

    def close(self) -> None:
        self._run.finish()


class _TrackioRun(_HostedRun):
    def close(self) -> None:
        # trackio.finish(), not Run.finish(): it also forgets the current run, which trackio's
        # exit hook would otherwise finish again (printing "Uploading logs" a second time).
        self._module.finish()


def _wandb(run: RunDir, project: str, name: str, params: dict[str, Any]) -> Tracker:
    import wandb

    # One W&B run per run folder: a resumed loop continues it rather than starting another.
    run_id = hashlib.sha256(str(run.root).encode()).hexdigest()[:16]
    # WANDB_MODE as it is now: wandb reads it once per process, when first set up, and a
    # process that used wandb before would otherwise keep that first mode.
    mode = {"mode": os.environ["WANDB_MODE"]} if os.environ.get("WANDB_MODE") else {}
    try:
        return _HostedRun(
            wandb, project=project, name=name, id=run_id, resume="allow", config=params,
            dir=str(run.root), settings=wandb.Settings(quiet=True),  # no 40-line run summary
            **mode,
        )  # fmt: skip
    except wandb.errors.UsageError as err:  # credentials _check_wandb_login could not see
        raise FlowGrpoError(_WANDB_LOGIN.format(why=f" ({err})")) from None


def _trackio(run: RunDir, project: str, name: str, params: dict[str, Any]) -> Tracker:
    import trackio

    return _TrackioRun(
        trackio, project=project, name=name, config=params, resume="allow", embed=False,
        auto_log_cpu=False, auto_log_gpu=False,
    )  # fmt: skip
