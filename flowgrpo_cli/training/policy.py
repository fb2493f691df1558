"""The policy: a model adapter plus the weights Flow-GRPO trains, and their checkpoints.

In LoRA mode a peft adapter (gaussian A, zero B) is attached to the transformer's modules
whenever a policy is loaded, in rollout as in the update, so both run the very same modules;
with B = 0 its output equals the base model's exactly. In full mode the transformer's own
weights are trained. A checkpoint folder holds the LoRA weights in diffusers' LoRA format, with
the adapter's config (rank, alpha, targets) in the file's metadata as diffusers writes it, so
`pipe.load_lora_weights(folder)` rebuilds the adapter at the scale alpha / r the policy
trained with (or the full transformer's weights); the EMA weights the same way in the
subfolder `ema/`; plus, written by the update, the optimizer and trainer state, and a manifest
written last.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models import ModelAdapter, load_adapter
from flowgrpo_cli.store.config import Config
from flowgrpo_cli.store.rundir import RunDir, atomic_file, read_manifest, sha256_file, verify_stage

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name
FULL_WEIGHTS = "transformer.safetensors"
LORA_PREFIX = "transformer."  # diffusers' key prefix of the transformer's LoRA layers
# A subfolder, not a second file beside the weights: given a folder, load_lora_weights picks any
# file ending in pytorch_lora_weights.safetensors, so an `ema_` copy there could be loaded instead.
EMA_FOLDER = "ema"
ANCHOR_FOLDER = "anchor"  # nft / awm: the soft-updated copy of the weights (training.trainer)
ADAPTER_NAME = "default"  # the name diffusers' add_adapter gives the one adapter we attach
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _LoraLayer(Protocol):
    """What the policy uses of peft's LoRA layers (lora.Linear and its kin): peft's common
    base, BaseTunerLayer, declares no get_delta_weight."""

    @property
    def active_adapters(self) -> list[str]: ...

    def enable_adapters(self, enabled: bool) -> None: ...

    def get_base_layer(self) -> torch.nn.Module: ...

    def get_delta_weight(self, adapter: str) -> torch.Tensor: ...


@dataclass
class Policy:
    adapter: ModelAdapter
    mode: str  # "lora" or "full"
    device: torch.device
    version: str  # "base", or "iter-N:<sha of the weights file>": which weights are loaded
    _lora_layers: list[_LoraLayer] | None = field(default=None, repr=False)

    @property
    def transformer(self) -> ModelMixin:
        return self.adapter.transformer

    @property
    def lora_layers(self) -> list[_LoraLayer]:
        """peft's LoRA-wrapped layers of the transformer, found once (LoRA mode)."""
        if self._lora_layers is None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            # cast: the only adapter attached is a LoRA one, so its layers are peft's LoRA layers.
            self._lora_layers = cast(
                "list[_LoraLayer]",
                [m for m in self.transformer.modules() if isinstance(m, BaseTunerLayer)],
            )
        return self._lora_layers

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """The base model (the KL reference) for the duration. Toggles peft's layers directly:
        diffusers' disable_adapters() re-reads peft's package metadata on every call, which cost
        the update 9% of its time on the tiny model (`just bench`, update breakdown)."""
        layers = self.lora_layers
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def check_mergeable(self) -> list[torch.nn.Module]:
        """The base layers lora_merged() would write, or why it cannot (sampler.merge_lora)."""
        if self.mode != "lora":
            raise FlowGrpoError(
                "sampler.merge_lora = true merges a LoRA adapter; train.mode = "
                f"{self.mode!r} has none: leave merge_lora off"
            )
        bases = [layer.get_base_layer() for layer in self.lora_layers]
        if any(base.weight.dtype != torch.float32 for base in bases):
            raise FlowGrpoError(
                'sampler.merge_lora = true needs model.dtype = "float32": merged into '
                "lower-precision weights, small LoRA updates would be rounded away"
            )
        if any(hasattr(base.weight, "full_tensor") for base in bases):
            raise FlowGrpoError(
                "sampler.merge_lora = true cannot merge into FSDP-sharded weights: run "
                "`flowgrpo loop` with one process, or leave merge_lora off"
            )
        return bases

    @contextlib.contextmanager
    def lora_merged(self) -> Iterator[None]:
        """Each LoRA layer runs as one plain matmul with W + scale * B A for the duration.

        The merged weights are new tensors and the originals come back afterwards, so the base
        weights never drift through a merge-unmerge round trip. Only for unsharded float32
        policies: rounding W + dW to bfloat16 would lose most of a small LoRA update.
        """
        bases = self.check_mergeable()
        saved = []
        with torch.no_grad(), self.adapters_disabled():
            try:
                for layer, base in zip(self.lora_layers, bases, strict=True):
                    # cast: a base layer's weight is a Parameter; torch types a module's
                    # attributes as Tensor | Module.
                    weight = cast(torch.Tensor, base.weight)
                    saved.append((base, weight))
                    delta = sum(layer.get_delta_weight(name) for name in layer.active_adapters)
                    base.weight = torch.nn.Parameter(weight + delta, requires_grad=False)
                yield
            finally:
                for base, weight in saved:
                    base.weight = weight

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]


def attach_lora(
    transformer: ModelMixin, *, rank: int, alpha: int, targets: list[str], seed: int
) -> None:
    """Add a trainable LoRA adapter; its gaussian A is drawn from `seed`, B starts at zero."""
    from peft import LoraConfig

    config = LoraConfig(
        r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            transformer.add_adapter(config)
        except ValueError as err:  # peft: "Target modules ... not found in the base model"
            raise FlowGrpoError(f"train.lora_targets {targets}: {err}") from None


def load_policy(config: Config, device: torch.device) -> Policy:
    """The base model with its trainable weights set up (LoRA attached, or all trainable)."""
    if not config.model.path:
        raise FlowGrpoError("model.path is not set: name a diffusers pipeline folder or hub id")
    adapter = load_adapter(config.model.path, dtype=DTYPES[config.model.dtype], device=device)
    adapter.latent_shape(config.model.height, config.model.width)  # a size it cannot draw
    transformer = adapter.transformer
    transformer.requires_grad_(False)
    if config.train.mode == "lora":
        targets = config.train.lora_targets or adapter.default_lora_targets
        attach_lora(
            transformer,
            rank=config.train.lora_rank,
            alpha=config.train.lora_alpha,
            targets=targets,
            seed=config.run.seed,
        )
        # peft marks only the adapter trainable; keep the LoRA weights in float32 so small
        # updates are not lost to a bfloat16 rounding of the weights themselves.
        for parameter in transformer.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()
    else:
        transformer.requires_grad_(True)
    if config.train.mixed_precision == "bfloat16":
        compute_in_bfloat16(transformer, device)
    policy = Policy(adapter=adapter, mode=config.train.mode, device=device, version="base")
    if config.model.init_lora:
        load_initial_lora(policy, Path(config.model.init_lora))
    return policy


def compute_in_bfloat16(transformer: torch.nn.Module, device: torch.device) -> None:
    """train.mixed_precision = "bfloat16": every forward of the transformer, in rollout,
    update and evaluation alike, runs under bfloat16 autocast, while its weights, gradients and
    optimizer state keep their own dtype. Under FSDP2 the trainer also gathers the parameters
    in bfloat16 (its MixedPrecisionPolicy).

    The forward is replaced on the instance by a bound method, so a deepcopy of the module
    (full mode's frozen reference) autocasts its own forward, not this one's.
    """
    # torch types Module.__setattr__'s value as Tensor | Module; any other value is stored too.
    transformer.flowgrpo_autocast_device = device.type  # type: ignore[assignment]
    transformer.forward = types.MethodType(_autocast_forward, transformer)


def _autocast_forward(module: torch.nn.Module, *args, **kwargs):
    # cast: compute_in_bfloat16 set it to a device type; torch types it as Tensor | Module.
    device_type = cast(str, module.flowgrpo_autocast_device)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        return type(module).forward(module, *args, **kwargs)


def load_initial_lora(policy: Policy, source: Path) -> None:
    """Start training from a trained LoRA (model.init_lora): the folder of a checkpoint or an
    export, or its weights file. The policy's version names the file, so rollouts sampled
    with it are told apart from the base's."""
    if policy.mode != "lora":
        raise FlowGrpoError(
            'model.init_lora continues a trained LoRA: it needs train.mode = "lora"'
        )
    path = source / LORA_WEIGHTS if source.is_dir() else source
    if not path.is_file():
        raise FlowGrpoError(
            f"model.init_lora: {path} does not exist (a folder holding {LORA_WEIGHTS}, such "
            "as a checkpoint or a `flowgrpo export`, or that file)"
        )
    state = read_weights(policy, path)  # a LoRA of another rank or alpha is refused here
    _load_lora_state(policy.transformer, state, path)
    policy.version = f"init:{sha256_file(path)[:16]}"


def checkpoint_for(run: RunDir, iteration: int) -> Path | None:
    """The checkpoint iteration `iteration` starts from: the update of iteration - 1."""
    if iteration == 0:
        return None
    folder = run.checkpoint_dir(iteration - 1)
    if read_manifest(folder) is None:
        raise FlowGrpoError(
            f"iteration {iteration} starts from {folder}, which is missing or incomplete: run "
            f"`flowgrpo update --iteration {iteration - 1}` (or `flowgrpo loop`) first"
        )
    return folder


def checkpoint_version(checkpoint: Path, mode: str, folder: str = "") -> str:
    """The policy version of a checkpoint's weights: 'iter-N:<sha of the weights file>', or
    'iter-N/FOLDER:<sha>' for the weights in one of its folders (the anchor)."""
    name = f"{checkpoint.name}/{folder}" if folder else checkpoint.name
    return f"{name}:{sha256_file(checkpoint / folder / weights_file(mode))[:16]}"


def weights_file(mode: str) -> str:
    return LORA_WEIGHTS if mode == "lora" else FULL_WEIGHTS


def write_weights(policy: Policy, path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Write trained weights (keyed as the transformer's own state dict) atomically to `path`.

    LoRA weights are written as diffusers' save_lora_weights() writes them: keys under
    `transformer.`, and the adapter's LoraConfig as JSON under the metadata key diffusers reads
    back (also prefixed). Without that config, load_lora_weights() would guess alpha = r and
    load the adapter at scale 1 instead of alpha / r. Not save_lora_weights() itself: it puts a
    second metadata key beside that one, and safetensors writes several in hash order, so the
    same weights gave other bytes in another process, and a resumed run no longer ended with
    the uninterrupted run's checkpoint. Full weights are a plain safetensors file.
    """
    from safetensors.torch import save

    metadata = None
    if policy.mode == "lora":
        from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

        adapter_config = policy.transformer.peft_config[ADAPTER_NAME].to_dict()
        config = {
            f"{LORA_PREFIX}{key}": sorted(value) if isinstance(value, set) else value
            for key, value in adapter_config.items()
        }  # target_modules is a set: sorted, so its order is the same in every process
        metadata = {LORA_ADAPTER_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)}
        weights = {f"{LORA_PREFIX}{key}": value for key, value in weights.items()}
    with atomic_file(path) as handle:
        handle.write(save(weights, metadata=metadata))


def read_weights(policy: Policy, path: Path) -> dict[str, torch.Tensor]:
    """The weights of a file write_weights() wrote, keyed as the transformer's state dict.

    A LoRA file that records another rank or alpha than the policy's adapter is refused: its
    weights would fit the layers, but run at another scale than the one they were trained at.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            state = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
            metadata = handle.metadata() or {}
    except SafetensorError as err:
        raise FlowGrpoError(f"{path}: {unreadable_safetensors(err)}") from None
    if policy.mode == "full":
        return state
    _check_lora_config(policy, path, metadata)
    return {key.removeprefix(LORA_PREFIX): value for key, value in state.items()}


def unreadable_safetensors(err: Exception) -> str:
    """What to say of a weights or optimizer file safetensors cannot read (after `PATH: `)."""
    return f"not a safetensors file ({err}): damaged or replaced after it was written"


def _check_lora_config(policy: Policy, path: Path, metadata: dict[str, str]) -> None:
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    recorded = metadata.get(LORA_ADAPTER_METADATA_KEY)
    if recorded is None:  # written before the config was recorded: nothing to compare
        return
    try:
        saved = json.loads(recorded)
    except json.JSONDecodeError:
        saved = None
    if not isinstance(saved, dict):
        raise FlowGrpoError(
            f"{path}: its LoRA config ({LORA_ADAPTER_METADATA_KEY} in the file's metadata) is "
            "not a JSON object: damaged or replaced after it was written"
        )
    own = policy.transformer.peft_config[ADAPTER_NAME]
    for key, value in (("r", own.r), ("lora_alpha", own.lora_alpha)):
        if saved.get(f"{LORA_PREFIX}{key}") != value:
            raise FlowGrpoError(
                f"{path} holds a LoRA with {key} = {saved.get(LORA_PREFIX + key)}, the policy's "
                f"adapter has {key} = {value}: set train.lora_rank / train.lora_alpha to the "
                "values it was trained with"
            )


def load_weights(policy: Policy, checkpoint: Path, folder: str = "") -> None:
    """Load the trained weights of `checkpoint` (or of its `folder`, e.g. the anchor) into the
    policy and tag its version. Every file of the checkpoint (weights, EMA, anchor, optimizer
    and trainer state) is checked against its manifest first, so neither these weights nor a
    resumed optimizer is a silently altered one."""
    manifest = read_manifest(checkpoint)
    if manifest is not None:
        require_weights(checkpoint, manifest)
        verify_stage(checkpoint)
    path = checkpoint / folder / weights_file(policy.mode)
    if not path.is_file():
        raise FlowGrpoError(
            f"{path} is missing: checkpoint {checkpoint} was not written in "
            f"train.mode = {policy.mode!r}"
        )
    state = read_weights(policy, path)
    if policy.mode == "lora":
        _load_lora_state(policy.transformer, state, path)
    else:
        _load_full_state(policy.transformer, state, path)
    policy.version = checkpoint_version(checkpoint, policy.mode, folder)


def require_weights(checkpoint: Path, manifest: dict) -> None:
    """Refuse a checkpoint whose weights run.keep_checkpoints deleted, saying so."""
    if "pruned" in manifest:
        raise FlowGrpoError(
            f"{checkpoint}: its weights were deleted to save disk (run.checkpoint_every = k "
            "keeps every k-th checkpoint and the latest; run.keep_checkpoints = K the last K "
            "of those): pick a checkpoint that kept them"
        )


def _load_lora_state(transformer: torch.nn.Module, state: dict, path: Path) -> None:
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    expected = get_peft_model_state_dict(transformer)
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        details = "; ".join(
            f"{label}: {keys[:3]}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("different shape", wrong),
            )
            if keys
        )
        raise FlowGrpoError(
            f"{path} does not match the model's LoRA layers ({details}); was it "
            "saved for another model, LoRA rank or target list?"
        )
    set_peft_model_state_dict(transformer, state)


def _load_full_state(transformer: torch.nn.Module, state: dict, path: Path) -> None:
    own = transformer.state_dict()
    bad = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    if bad or len(state) != len(own):
        raise FlowGrpoError(
            f"{path} does not match the transformer's weights (first differences: {bad[:3]})"
        )
    transformer.load_state_dict(state)
