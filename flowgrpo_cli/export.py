"""`flowgrpo export`: a run's checkpoint as what a user takes away.

A LoRA run exports its adapter as a folder `pipe.load_lora_weights(folder)` reads (the file
the checkpoint already holds, with rank and alpha in its metadata); `merged` exports a whole
pipeline folder with the weights fused in, which `DiffusionPipeline.from_pretrained` loads with
no LoRA step; a full fine-tuning run always exports the whole pipeline (it has no adapter).
Both carry a model card (README.md) and the run's config; an editing run's also carry the
source image the card's code edits. The folder is written beside OUT and
renamed into place at the end, so a failed or killed export leaves no half-written model (the
next export to the same OUT deletes what a killed one left beside it). It
takes no lock (finished checkpoints are never rewritten), so a run exports while it trains.
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.model_card import CONFIG_COPY, card_files, model_card
from flowgrpo_cli.store.config import Config
from flowgrpo_cli.store.rundir import RunDir, read_manifest, verify_part, verify_stage

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Exported:
    folder: Path
    iteration: int  # the checkpoint's iteration: checkpoints/iter-N
    weights: str  # "policy" or "ema"
    merged: bool


def export_checkpoint(
    config: Config,
    run: RunDir,
    out: Path,
    *,
    iteration: int | None = None,
    ema: bool = False,
    merged: bool = False,
    dtype: str | None = None,
    command: str = "",
) -> Exported:
    """Write checkpoint `iteration` (default: the latest) of `run` to the new folder `out`."""
    from flowgrpo_cli.training.policy import EMA_FOLDER, require_weights, weights_file

    number = _checkpoint_iteration(run, iteration)
    checkpoint = run.checkpoint_dir(number)
    manifest = verify_stage(checkpoint)  # the weights are the ones the update wrote
    require_weights(checkpoint, manifest)
    source = checkpoint / EMA_FOLDER if ema else checkpoint
    weights = source / weights_file(config.train.mode)
    if not weights.is_file():
        if ema:
            raise FlowGrpoError(
                f"--ema: {checkpoint} holds no EMA weights (the run trained with "
                "train.ema_decay = 0); export without --ema"
            )
        raise FlowGrpoError(f"{weights} is missing: was the run trained in another train.mode?")
    _check_weights_file(weights)
    _check_new_folder(out)
    merged = merged or config.train.mode == "full"
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_killed_exports(out)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    staging.mkdir()
    try:
        (staging / _STAGING_MARK).write_bytes(b"")
        if merged:
            _write_pipeline(config, weights, staging, dtype)
        else:
            shutil.copyfile(weights, staging / weights.name)
            _check_copy(staging / weights.name, manifest, weights.relative_to(checkpoint))
        shutil.copyfile(run.config_path, staging / CONFIG_COPY)
        card = model_card(config, run, number, ema=ema, merged=merged, command=command)
        (staging / "README.md").write_text(card)
        for name, data in card_files(config, run).items():  # the source image its code edits
            (staging / name).write_bytes(data)
        (staging / _STAGING_MARK).unlink()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Exported(out, number, "ema" if ema else "policy", merged)


# The export is staged in OUT's folder as `.OUT.tmp-PID`, holding this file until renamed.
_STAGING_MARK = ".flowgrpo-export-staging"


def _remove_killed_exports(out: Path) -> None:
    """Delete what killed exports to `out` left: their staging folders, known by name and
    mark, whose process has ended (a running export's is left alone)."""
    from flowgrpo_cli.store.rundir import process_ended

    for path in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        pid = path.name.removeprefix(f".{out.name}.tmp-")
        if not pid.isdigit() or path.is_symlink() or not (path / _STAGING_MARK).is_file():
            continue
        if process_ended(int(pid)):
            shutil.rmtree(path)


def _checkpoint_iteration(run: RunDir, iteration: int | None) -> int:
    done = run.current_iteration()  # checkpoints 0 .. done - 1 are finished
    if done == 0:
        raise FlowGrpoError(
            f"{run.root} has no finished update yet, so no checkpoint to export: run "
            "`flowgrpo loop` (or `flowgrpo update`) first"
        )
    if iteration is None:
        return done - 1
    if read_manifest(run.checkpoint_dir(iteration)) is None:
        raise FlowGrpoError(
            f"--iteration {iteration}: {run.checkpoint_dir(iteration)} is missing or "
            f"unfinished; finished checkpoints are iterations 0 to {done - 1}"
        )
    return iteration


def _check_copy(copy: Path, manifest: dict[str, Any], name: Path) -> None:
    """The copy is the file the manifest records: export takes no lock, and a checkpoint
    pruned (run.keep_checkpoints) while it was copied must not pass for a good one."""
    recorded = next(part for part in manifest["parts"] if part["name"] == str(name))
    verify_part(copy, recorded, redo="the checkpoint changed while it was copied; retry")


def _check_weights_file(weights: Path) -> None:
    """A weights file whose bytes match a re-hashed manifest is still read before it is
    exported: what is handed on must be a safetensors file."""
    from safetensors import SafetensorError, safe_open

    from flowgrpo_cli.training.policy import unreadable_safetensors

    try:
        with safe_open(str(weights), framework="pt") as handle:
            handle.keys()
    except SafetensorError as err:
        raise FlowGrpoError(f"{weights}: {unreadable_safetensors(err)}") from None


def _check_new_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FlowGrpoError(f"{out} already exists and is not an empty folder: choose a new one")
    if out.exists():
        out.rmdir()  # an empty folder is replaced by the rename


def _write_pipeline(config: Config, weights: Path, folder: Path, dtype: str | None) -> None:
    """The base pipeline with the trained weights in it, as save_pretrained() writes it.

    Loaded and fused in float32 whatever the base's precision, so a small LoRA update is not
    rounded away before it is added; then cast to `dtype` (default: model.dtype).
    """
    import torch

    from flowgrpo_cli.models import load_adapter
    from flowgrpo_cli.training.policy import DTYPES, LORA_WEIGHTS

    adapter = load_adapter(config.model.path, dtype=torch.float32, device="cpu")
    pipeline = adapter.pipeline
    if weights.name == LORA_WEIGHTS:
        # Through diffusers' own loader, as a user would: it reads rank and alpha from the file.
        pipeline.load_lora_weights(str(weights.parent))
        pipeline.fuse_lora()
        pipeline.unload_lora_weights()
    else:
        from safetensors.torch import load_file

        _load_transformer(pipeline.transformer, load_file(weights), weights)
    pipeline.to(DTYPES[dtype or config.model.dtype])
    adapter.save_pretrained(folder)  # as the base's folder reads (the edit family's processor)


def _load_transformer(
    transformer: torch.nn.Module, state: dict[str, torch.Tensor], path: Path
) -> None:
    """Full weights into the base transformer: every parameter must be there. The EMA file
    holds parameters only; the buffers (SD3's positional table) stay the base's, as in training.
    """
    missing, unexpected = transformer.load_state_dict(state, strict=False)
    buffers = {name for name, _ in transformer.named_buffers()}
    missing_parameters = sorted(set(missing) - buffers)
    if missing_parameters or unexpected:
        raise FlowGrpoError(
            f"{path} does not match the base model's transformer: missing "
            f"{missing_parameters[:3]}, unexpected {sorted(unexpected)[:3]}"
        )


def push_to_hub(folder: Path, repo: str, *, private: bool = False) -> str:
    """Upload an exported folder to the Hugging Face Hub repo `repo`; the repo's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    from flowgrpo_cli.hub_errors import offline_note

    api = HfApi()
    try:
        url = api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo, folder_path=str(folder), commit_message=f"flowgrpo export {folder.name}"
        )
    except OfflineModeIsEnabled:
        raise FlowGrpoError(
            f"--push-to-hub {repo}: {offline_note()}. The export itself is in {folder}"
        ) from None
    except _connection_errors() as err:  # no network, a proxy or DNS failure, a timeout
        hint = offline_note() or "check the network (and HF_ENDPOINT if you set it)"
        raise FlowGrpoError(
            f"--push-to-hub {repo}: cannot reach the Hub at {api.endpoint} "
            f"({type(err).__name__}: {err}); {hint}, then upload with `hf upload {repo} "
            f"{folder}`. The export itself is in {folder}"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise FlowGrpoError(
            f"--push-to-hub {repo} failed: {err}. The export itself is in {folder}"
        ) from None
    return str(url)


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub's HTTP client raises when the Hub cannot be reached: the transport
    errors of httpx (huggingface_hub 1.x) or its fork httpx2 (2.x), requests' connection
    errors and timeouts (0.x). Only the clients installed are asked."""
    import importlib

    errors: list[type[BaseException]] = []
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):  # fmt: skip
        try:
            client = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(client, name) for name in names if hasattr(client, name)]
    return tuple(errors)
