"""A model's architecture without its weights: built on the meta device from config.json files.

`resolve_architecture` finds the configs of a pipeline: a local diffusers folder (its
model_index.json and each component's config.json; no weight file is opened), a hub id whose
configs sit in the local hub cache, or one of the published architectures kept in
flowgrpo_cli/models/architectures/*.json (SD3.5-Medium, FLUX.1-dev, FLUX.1-schnell,
FLUX.1-Kontext-dev, Qwen-Image; public config values, no weights). Each component is then
built on the meta device, which allocates nothing, and its parameters and buffers counted.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgrpo_cli.errors import FlowGrpoError

if TYPE_CHECKING:
    import torch

ARCHITECTURES_DIR = Path(__file__).resolve().parents[1] / "models" / "architectures"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The CLIP models of the model rewards, as released (config.json of each hub repository):
# benchmarks/reward_memory.py reads them from here too. Each is a config.json's dict, as
# CLIPConfig.from_dict takes it.
CLIP_L14: dict[str, Any] = {  # openai/clip-vit-large-patch14
    "text_config": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "vocab_size": 49408,
        "max_position_embeddings": 77,
    },
    "vision_config": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "image_size": 224,
        "patch_size": 14,
    },
    "projection_dim": 768,
}
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K, and yuvalkirstain/PickScore_v1
CLIP_H14: dict[str, Any] = {
    "text_config": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "vocab_size": 49408,
        "max_position_embeddings": 77,
    },
    "vision_config": {
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "num_attention_heads": 16,
        "num_hidden_layers": 32,
        "image_size": 224,
        "patch_size": 14,
    },
    "projection_dim": 1024,
}
# HPSv2 fine-tunes open_clip's ViT-H-14: the same shapes as CLIP_H14.
REWARD_CLIPS = {
    "pickscore": CLIP_H14, "clipscore": CLIP_L14, "aesthetic": CLIP_L14, "hpsv2": CLIP_H14,
}  # fmt: skip


@dataclass(frozen=True)
class Component:
    """One torch component of a pipeline: element counts by how from_pretrained casts them."""

    name: str
    class_name: str
    parameters: int
    buffers: int  # floating buffer elements (SD3's pos_embed: 226M of them)
    fp32_on_fp16: int = 0  # elements transformers keeps in float32 when loading float16
    fp32_always: int = 0  # ... in float16 and bfloat16 (`_keep_in_fp32_modules_strict`)

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of parameters and buffers once loaded with `dtype=dtype`, as the pipeline's
        from_pretrained loads every component."""
        size = DTYPE_BYTES[dtype]
        kept = self.fp32_always + (self.fp32_on_fp16 if dtype == "float16" else 0)
        if dtype == "float32":
            kept = 0
        return (self.parameters + self.buffers - kept) * size + kept * 4


@dataclass
class Architecture:
    """What the planner needs of a pipeline: its components, the transformer's shapes, and
    the meta-device transformer (for LoRA counts)."""

    name: str  # the published architecture's name, or the folder
    source: str  # how it was found, for the plan's header
    family: str  # sd3, flux, qwenimage, qwenimage_edit, flux_kontext
    components: dict[str, Component]
    transformer_config: dict[str, Any]
    vae_scale_factor: int
    blocks: dict[str, int]  # block kind -> count (kinds of planning.memory.ACTIVATION)
    largest_block: int  # parameters of the largest transformer block (FSDP gathers it)
    outside_blocks: int  # transformer parameters outside its blocks
    encoder_widths: dict[str, int] = field(default_factory=dict)
    transformer_module: torch.nn.Module | None = field(default=None, repr=False)
    _lora: dict[tuple[tuple[str, ...], int], tuple[int, int]] = field(
        default_factory=dict, repr=False
    )

    @property
    def inner(self) -> int:
        c = self.transformer_config
        return int(c["num_attention_heads"]) * int(c["attention_head_dim"])

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.transformer_config.get("guidance_embeds", False))

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        channels = latent_channels(self.family, self.transformer_config)
        factor = self.vae_scale_factor
        return (channels, height // factor, width // factor)

    @property
    def base_family(self) -> str:
        """The family whose blocks, text encoders and guidance this one has: an edit family's
        text-to-image family, else its own."""
        return EDIT_FAMILY_BASES.get(self.family, self.family)

    def image_tokens(self, height: int, width: int) -> int:
        _, h, w = self.latent_shape(height, width)
        return (h // 2) * (w // 2)  # SD3's 2x2 patches, FLUX / Qwen-Image's 2x2 packing

    @property
    def source_tokens(self) -> int:
        """Tokens of an edit family's source image (0 for the others): its latents, packed
        2x2, follow the generated tokens in every forward."""
        return self.adapter_class().source_pixels // (self.vae_scale_factor * 2) ** 2

    @property
    def source_elements(self) -> int:
        """Elements of an edit family's source latents, stored once per prompt."""
        channels = latent_channels(self.family, self.transformer_config)
        return channels * self.adapter_class().source_pixels // self.vae_scale_factor**2

    def default_lora_targets(self) -> list[str]:
        return list(self.adapter_class().default_lora_targets.fget(None))  # no pipeline needed

    def adapter_class(self) -> Any:
        """The family's adapter class (its class attributes need no pipeline)."""
        from flowgrpo_cli.models import FAMILIES

        module, name = next(iter(FAMILIES[self.family].values())).split(":")
        return getattr(importlib.import_module(module), name)

    def lora(self, targets: list[str], rank: int) -> tuple[int, int]:
        """(parameters, tensors) of a LoRA adapter of `rank` on `targets`: attached with peft
        to the meta-device transformer, exactly as training attaches it."""
        key = (tuple(targets), rank)
        if key not in self._lora:
            import copy

            from diffusers.loaders.peft import PeftAdapterMixin
            from peft import LoraConfig

            if self.transformer_module is None:
                raise FlowGrpoError(f"{self.source}: built without its transformer module")
            module = copy.deepcopy(self.transformer_module).requires_grad_(False)
            if not isinstance(module, PeftAdapterMixin):
                raise FlowGrpoError(
                    f"{self.source}: {type(module).__name__} takes no LoRA adapter (add_adapter)"
                )
            config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets)
            try:
                module.add_adapter(config)
            except ValueError as err:
                raise FlowGrpoError(f"train.lora_targets {targets}: {err}") from None
            trained = [p for p in module.parameters() if p.requires_grad]
            self._lora[key] = (sum(p.numel() for p in trained), len(trained))
        return self._lora[key]


# An edit family plans as the text-to-image family it extends, plus its source image's tokens.
EDIT_FAMILY_BASES = {"qwenimage_edit": "qwenimage", "flux_kontext": "flux"}


def latent_channels(family: str, transformer_config: dict[str, Any]) -> int:
    """Latent channels from the transformer's config.json: FLUX and Qwen-Image take 2x2-packed
    latents, so their `in_channels` is four times the VAE's."""
    channels = int(transformer_config["in_channels"])
    return channels if family == "sd3" else channels // 4


def vae_scale_factor(vae_config: dict[str, Any]) -> int | None:
    """The VAE's downscale factor from its config.json; None when it says nothing of it."""
    if isinstance(vae_config.get("temperal_downsample"), list):  # AutoencoderKLQwenImage
        return 2 ** len(vae_config["temperal_downsample"])
    if isinstance(vae_config.get("block_out_channels"), list):
        return 2 ** (len(vae_config["block_out_channels"]) - 1)
    return None


def known_architectures() -> dict[str, dict[str, Any]]:
    """name -> the JSON of each published architecture kept in the package."""
    return {
        path.stem: json.loads(path.read_text()) for path in sorted(ARCHITECTURES_DIR.glob("*.json"))
    }


def resolve_architecture(model_path: str, arch: str | None = None) -> Architecture:
    """The architecture of `model_path` (or of `arch`, a published name or a local folder)."""
    known = known_architectures()
    if arch:
        if arch in known:
            return _from_spec(arch, f"--arch {arch}", known[arch])
        if Path(arch).expanduser().is_dir():
            return _from_folder(Path(arch).expanduser())
        raise FlowGrpoError(
            f"--arch {arch!r}: not a known architecture ({', '.join(known)}) nor a local "
            "diffusers folder"
        )
    if not model_path:
        raise FlowGrpoError(
            "model.path is not set: name a diffusers folder or hub id (or pass --arch NAME, "
            f"one of {', '.join(known)})"
        )
    folder = Path(model_path).expanduser()
    if folder.is_dir():
        return _from_folder(folder)
    for name, spec in known.items():
        if model_path in spec["hub_ids"]:
            return _from_spec(name, f"hub id {model_path} (published config)", spec)
    cached = _from_hub_cache(model_path)
    if cached is not None:
        return cached
    raise FlowGrpoError(
        f"model.path {model_path!r} is no local folder, and flowgrpo knows no architecture "
        f"for that hub id offline: pass --arch NAME (one of {', '.join(known)}), or point "
        "model.path at a local diffusers folder (its model_index.json and config.json files "
        "are enough; no weights are read)"
    )


_BUILT: dict[str, Architecture] = {}


def _from_spec(name: str, source: str, spec: dict[str, Any]) -> Architecture:
    """A published architecture, built once per process (the files never change)."""
    if name not in _BUILT:
        _BUILT[name] = build(name, source, spec["model_index"], spec["configs"])
    built = _BUILT[name]
    return built if built.source == source else replace(built, source=source)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise FlowGrpoError(f"{path}: cannot read it as JSON: {err}") from None


def _from_folder(folder: Path) -> Architecture:
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise FlowGrpoError(
            f"{folder} has no model_index.json, so it is not a diffusers pipeline folder"
        )
    index = _read_json(index_file)
    configs = {
        name: _read_json(folder / name / "config.json")
        for name in index
        if not name.startswith("_") and (folder / name / "config.json").is_file()
    }
    return build(str(folder), f"local folder {folder}", index, configs)


def _from_hub_cache(hub_id: str) -> Architecture | None:
    """The configs of `hub_id` from the local hub cache (never the network), if all there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        index_file = try_to_load_from_cache(hub_id, "model_index.json")
    except Exception:  # an id the hub client refuses (a path, say): not cached
        return None
    if not isinstance(index_file, str):
        return None
    index = _read_json(Path(index_file))
    configs = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        if name.startswith(("tokenizer", "scheduler", "feature_extractor", "processor")):
            continue
        found = try_to_load_from_cache(hub_id, f"{name}/config.json")
        if not isinstance(found, str):
            return None
        configs[name] = _read_json(Path(found))
    return build(hub_id, f"hub id {hub_id} (configs in the local hub cache)", index, configs)


def build(
    name: str, source: str, index: dict[str, Any], configs: dict[str, dict[str, Any]]
) -> Architecture:
    """Build every component with a config on the meta device and count it."""
    from diffusers.configuration_utils import ConfigMixin

    from flowgrpo_cli.models import family_of

    pipeline_class = index.get("_class_name")
    if not isinstance(pipeline_class, str):
        raise FlowGrpoError(f"{source}: model_index.json has no _class_name")
    family = family_of(pipeline_class, where=f"model_index.json of {source}")
    if "transformer" not in configs:
        raise FlowGrpoError(f"{source}: no transformer config (transformer/config.json)")
    _quiet()
    components: dict[str, Component] = {}
    modules: dict[str, torch.nn.Module] = {}
    for component, config in configs.items():
        spec = index.get(component)
        if not isinstance(spec, list) or len(spec) != 2 or spec[0] is None:
            continue
        library, class_name = spec
        module = _meta_module(library, class_name, config, f"{source}: {component}")
        modules[component] = module
        components[component] = _count(component, class_name, module, library)
    transformer = modules["transformer"]
    if not isinstance(transformer, ConfigMixin):
        raise FlowGrpoError(
            f"{source}: the transformer, {type(transformer).__name__}, is not a diffusers model"
        )
    blocks, largest, inside = _blocks(EDIT_FAMILY_BASES.get(family, family), transformer)
    scale = vae_scale_factor(configs.get("vae", {})) or 8  # diffusers' default VAE: 4 levels
    widths = {
        n: int(
            c.get("hidden_size")
            or c.get("d_model")
            or c.get("text_config", {}).get("hidden_size", 0)
        )
        for n, c in configs.items()
        if n.startswith("text_encoder")
    }
    return Architecture(
        name=name,
        source=source,
        family=family,
        components=components,
        transformer_config=dict(transformer.config),
        vae_scale_factor=scale,
        blocks=blocks,
        largest_block=largest,
        outside_blocks=components["transformer"].parameters - inside,
        encoder_widths=widths,
        transformer_module=transformer,
    )


def _quiet() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()


def _meta_module(
    library: str, class_name: str, config: dict[str, Any], where: str
) -> torch.nn.Module:
    import torch

    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise FlowGrpoError(f"{where}: {library} has no class {class_name}") from None
    try:
        with torch.device("meta"):
            if library == "diffusers":
                return cls.from_config(config)
            return cls(cls.config_class.from_dict(config))
    except (TypeError, ValueError, KeyError) as err:
        raise FlowGrpoError(f"{where}: cannot build {class_name} from its config: {err}") from None


def _count(name: str, class_name: str, module: torch.nn.Module, library: str) -> Component:
    """Element counts; transformers' buffers (rotary frequencies) stay float32 when loaded,
    diffusers' (SD3's position embedding) take the model's dtype."""
    parameters = sum(p.numel() for p in module.parameters())
    buffers = sum(b.numel() for b in module.buffers() if b.is_floating_point())

    def matching(patterns: Sequence[str] | None) -> int:
        if not patterns:
            return 0
        return sum(
            t.numel()
            for n, t in [*module.named_parameters(), *module.named_buffers()]
            if t.is_floating_point() and any(p in n for p in patterns)
        )

    return Component(
        name=name,
        class_name=class_name,
        parameters=parameters,
        buffers=buffers,
        fp32_on_fp16=matching(getattr(module, "_keep_in_fp32_modules", None)),
        fp32_always=matching(getattr(module, "_keep_in_fp32_modules_strict", None))
        + (buffers if library == "transformers" else 0),
    )


# The blocks FSDP shards one by one (training.trainer._blocks): ModuleLists named *blocks.
def _blocks(family: str, transformer: torch.nn.Module) -> tuple[dict[str, int], int, int]:
    """(block kind -> count, parameters of the largest block, parameters in all blocks)."""
    import torch

    kinds: dict[str, int] = {}
    largest = inside = 0
    for child_name, child in transformer.named_children():
        if not isinstance(child, torch.nn.ModuleList) or not child_name.endswith("blocks"):
            continue
        for block in child:
            if family == "sd3":
                kind = "sd35_dual" if getattr(block, "attn2", None) is not None else "sd3"
            elif family == "flux":
                kind = "flux_single" if child_name.startswith("single") else "flux_double"
            else:
                kind = "qwen"
            kinds[kind] = kinds.get(kind, 0) + 1
            size = sum(p.numel() for p in block.parameters())
            largest = max(largest, size)
            inside += size
    return kinds, largest, inside


def reward_model_parameters(name: str) -> int:
    """Parameters of a model reward's released CLIP (built on the meta device)."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    with torch.device("meta"):
        model = CLIPModel(CLIPConfig.from_dict(REWARD_CLIPS[name]))
    return sum(p.numel() for p in model.parameters())


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
