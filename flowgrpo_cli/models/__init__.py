"""Model adapters: find a checkpoint's pipeline family and load its adapter.

A model is a diffusers pipeline folder (what save_pretrained writes) or a Hugging Face hub id.
Its model_index.json names the pipeline class (`_class_name`); `FAMILIES` maps each class we
support to its adapter, imported only when that family is loaded, so importing this package
stays free of diffusers (whose import alone takes seconds).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.hub_errors import hub_error_message
from flowgrpo_cli.loading import quiet_loading
from flowgrpo_cli.models.base import Conditioning, ModelAdapter, to_pil, to_png

__all__ = [
    "FAMILIES",
    "Conditioning",
    "ModelAdapter",
    "family_of",
    "load_adapter",
    "to_pil",
    "to_png",
]

#: family -> diffusers pipeline class name -> "module:Class" of its adapter.
FAMILIES: dict[str, dict[str, str]] = {
    "sd3": {"StableDiffusion3Pipeline": "flowgrpo_cli.models.sd3:SD3Adapter"},
    "flux": {"FluxPipeline": "flowgrpo_cli.models.flux:FluxAdapter"},
    "qwenimage": {"QwenImagePipeline": "flowgrpo_cli.models.qwenimage:QwenImageAdapter"},
    "qwenimage_edit": {
        "QwenImageEditPipeline": "flowgrpo_cli.models.qwenimage_edit:QwenImageEditAdapter"
    },
    "flux_kontext": {"FluxKontextPipeline": "flowgrpo_cli.models.flux_kontext:FluxKontextAdapter"},
}


def _supported() -> str:
    return ", ".join(f"{cls} ({family})" for family, classes in FAMILIES.items() for cls in classes)


def family_of(pipeline_class: str, *, where: str = "model_index.json") -> str:
    """The family of a diffusers pipeline class name, or a FlowGrpoError listing those we have."""
    for family, classes in FAMILIES.items():
        if pipeline_class in classes:
            return family
    raise FlowGrpoError(
        f"{where} names the pipeline class {pipeline_class!r}, which flowgrpo has no adapter "
        f"for. Supported: {_supported()}."
    )


def load_adapter(
    path_or_hub_id: str | os.PathLike[str], *, dtype: torch.dtype, device: torch.device | str
) -> ModelAdapter:
    """Load a pipeline (all components in `dtype`, on `device`) wrapped in its family's adapter.

    A path that exists is a local folder; anything else is taken as a hub id.
    """
    source = str(path_or_hub_id)
    folder = Path(source).expanduser()
    if folder.exists():
        index = _read_local_index(folder)
        where = str(folder / "model_index.json")
        pretrained: str = str(folder)
    else:
        index = _read_hub_index(source)
        where = f"model_index.json of hub model {source!r}"
        pretrained = source
    pipeline_class = index.get("_class_name")
    if not isinstance(pipeline_class, str):
        raise FlowGrpoError(f"{where} has no _class_name naming the pipeline class.")
    family = family_of(pipeline_class, where=where)
    if folder.exists():
        _check_components(folder, index)

    from diffusers import DiffusionPipeline

    quiet_loading()
    try:
        components = _own_components(family, pretrained)
        pipeline = DiffusionPipeline.from_pretrained(pretrained, dtype=dtype, **components)
    except (OSError, ValueError) as err:
        hint = None if folder.exists() else hub_error_message(err, source)
        if hint is not None:
            raise FlowGrpoError(f"model.path = {source!r}: {hint}") from None
        raise FlowGrpoError(f"Could not load the {pipeline_class} {source}: {err}") from err
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    module_name, class_name = FAMILIES[family][pipeline_class].split(":")
    adapter_class = getattr(importlib.import_module(module_name), class_name)
    return adapter_class(pipeline)


def _own_components(family: str, pretrained: str) -> dict[str, Any]:
    """Components loaded here rather than by from_pretrained: the edit pipeline's processor,
    image half only (flowgrpo_cli.models.qwenimage_edit says why)."""
    if family != "qwenimage_edit":
        return {}
    from diffusers import DiffusionPipeline

    from flowgrpo_cli.models.qwenimage_edit import load_processor

    folder = Path(pretrained)
    if not folder.is_dir():  # a hub id: the snapshot from_pretrained then reads from cache
        folder = Path(DiffusionPipeline.download(pretrained))
    return {"processor": load_processor(folder / "processor")}


def _read_local_index(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise FlowGrpoError(f"Model path {folder} is a file; expected a diffusers pipeline folder.")
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise FlowGrpoError(
            f"{folder} has no model_index.json, so it is not a diffusers pipeline folder "
            "(save_pretrained writes one; `flowgrpo tiny-model` builds a small one)."
        )
    try:
        return json.loads(index_file.read_text())
    except json.JSONDecodeError as err:
        raise FlowGrpoError(f"{index_file} is not valid JSON: {err}") from err


def _read_hub_index(hub_id: str) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError

    try:
        index_file = hf_hub_download(hub_id, "model_index.json")
    except HFValidationError as err:
        # Not a valid repo id either (e.g. an absolute path): it was meant as a folder.
        raise FlowGrpoError(f"Model folder {hub_id} does not exist.") from err
    except (OSError, ValueError) as err:
        hint = hub_error_message(err, hub_id)
        if hint is not None:
            raise FlowGrpoError(f"model.path = {hub_id!r}: {hint}") from None
        raise FlowGrpoError(
            f"{hub_id!r} is not a local folder, and reading model_index.json of the hub model "
            f"{hub_id!r} failed: {err}"
        ) from err
    return json.loads(Path(index_file).read_text())


def _check_components(folder: Path, index: dict[str, Any]) -> None:
    """Name a missing component folder before from_pretrained fails on it less clearly."""
    for name, spec in index.items():
        # Components are [library, class]; unset optional ones are [null, null].
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        if not (folder / name).is_dir():
            raise FlowGrpoError(
                f"{folder} is incomplete: model_index.json lists the component {name!r} "
                f"({'.'.join(map(str, spec))}) but the folder {folder / name} is missing."
            )
