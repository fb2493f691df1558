"""The trainer: the policy's trainable weights under FSDP2, AdamW, warm-up, EMA, checkpoints.

It lives as long as the process: a standalone `flowgrpo update` builds one from the previous
iteration's checkpoint, `flowgrpo loop` keeps one across iterations. Either way the weights and
the optimizer state after iteration N are what checkpoints/iter-N holds, bit for bit, which is
what lets a killed loop resume to the same final checkpoint.

With more than one rank the transformer is sharded with FSDP2 (`fully_shard` on every block,
then on the root); the base weights are frozen, the LoRA weights (or, in full mode, all of them)
are trained. Gradients are averaged over ranks by FSDP; the update stage scales each rank's
loss by the world size so the step equals the single-process step on the same global batch.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import torch

from flowgrpo_cli.algorithm.anchor import anchor_decay
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import dist_info
from flowgrpo_cli.store.config import Config
from flowgrpo_cli.store.rundir import atomic_file, atomic_write_bytes
from flowgrpo_cli.training.algorithms import algorithm_for
from flowgrpo_cli.training.policy import (
    ANCHOR_FOLDER,
    EMA_FOLDER,
    Policy,
    checkpoint_version,
    read_weights,
    unreadable_safetensors,
    weights_file,
    write_weights,
)

OPTIMIZER_STATE = "optimizer.safetensors"
TRAINER_STATE = "trainer_state.json"


@dataclass
class TrainerState:
    """Progress saved with each checkpoint (and checked on resume)."""

    iteration: int = -1  # last finished iteration
    optimizer_steps: int = 0
    config_hash: str = ""


class Trainer:
    def __init__(self, config: Config, policy: Policy):
        self.config = config
        self.policy = policy
        self.state = TrainerState()
        self.world_size = dist_info().world_size
        train = config.train
        if train.gradient_checkpointing:
            policy.transformer.enable_gradient_checkpointing()
        self.reference = self._make_reference() if config.algorithm.beta > 0 else None
        if self.world_size > 1:
            self._shard()
        self.parameters = {
            n: p for n, p in policy.transformer.named_parameters() if p.requires_grad
        }
        if not self.parameters:
            raise FlowGrpoError("no trainable parameters: check train.mode and lora_targets")
        self.optimizer = torch.optim.AdamW(
            list(self.parameters.values()), lr=train.lr, weight_decay=train.weight_decay
        )
        self.ema = self._copy_of_weights() if train.ema_decay > 0 else None
        # A soft-updated copy of the weights (algorithm/anchor.py): nft samples with it, awm
        # keeps the policy near it, grpo_guard's is the weights that sampled. It starts as the
        # policy itself.
        self.algorithm = algorithm_for(config)
        self.anchor_schedule = self.algorithm.anchor_schedule()
        self.anchor = self._copy_of_weights() if self.anchor_schedule is not None else None
        self.anchor_version = policy.version

    def _copy_of_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.parameters.items()}

    # -- set-up ------------------------------------------------------------------------------

    def _make_reference(self) -> torch.nn.Module | None:
        """Full mode needs a frozen copy of the base transformer; LoRA mode disables the
        adapter instead (no extra memory)."""
        if self.policy.mode == "lora":
            return None
        reference = copy.deepcopy(self.policy.transformer).requires_grad_(False)
        return reference.eval()

    def _shard(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.config.train.mixed_precision == "bfloat16"
            else MixedPrecisionPolicy()
        )
        for module in [self.policy.transformer, self.reference]:
            if module is None:
                continue
            for block in _blocks(module):
                fully_shard(block, mp_policy=mp)
            fully_shard(module, mp_policy=mp)

    # -- reference forward --------------------------------------------------------------------

    def reference_context(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the adapter's velocity is the reference's (LoRA disabled), or a
        module to call instead (full mode)."""
        if self.policy.mode == "lora":
            return self.policy.adapters_disabled()
        if self.reference is None:  # made when algorithm.beta > 0, which callers check first
            raise FlowGrpoError("algorithm.beta = 0 keeps no reference model")
        return _SwapTransformer(self.policy.adapter, self.reference)

    # -- optimizer step -----------------------------------------------------------------------

    def learning_rate(self) -> float:
        warmup = self.config.train.warmup_steps
        scale = min(1.0, (self.state.optimizer_steps + 1) / warmup) if warmup else 1.0
        return self.config.train.lr * scale

    def step(self) -> dict[str, float]:
        """Clip, check and apply the accumulated gradients; returns grad norm and lr."""
        params = list(self.parameters.values())
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.train.max_grad_norm)
        norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not torch.isfinite(torch.tensor(norm_value)):
            raise FlowGrpoError(
                f"non-finite gradient norm at optimizer step {self.state.optimizer_steps} "
                "(a non-finite loss or reward); no checkpoint was written for this iteration"
            )
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.optimizer_steps += 1
        self._update_ema()
        return {"grad_norm": norm_value, "lr": lr}

    def ema_decay(self) -> float:
        """The EMA's decay after n optimizer steps: min(ema_decay, (1 + n) / (10 + n)), the
        reference's warm-up, so the first updates follow the weights instead of lagging
        behind their (zero) start."""
        n = self.state.optimizer_steps
        return min(self.config.train.ema_decay, (1 + n) / (10 + n))

    def _update_ema(self) -> None:
        if self.ema is None or self.state.optimizer_steps % self.config.train.ema_interval:
            return
        weight = 1.0 - self.ema_decay()
        with torch.no_grad():
            for name, param in self.parameters.items():
                self.ema[name].lerp_(param.detach(), weight)

    def ema_weights(self) -> contextlib.AbstractContextManager[None]:
        """Evaluate with the EMA of the trained weights (no-op when EMA is off); the policy's
        version says so, so an evaluation of EMA weights is never mistaken for the raw ones."""
        if self.ema is None:
            return contextlib.nullcontext()
        return self._swapped_in(self.ema, f"{self.policy.version}+ema")

    def _samples_with_anchor(self) -> bool:
        return self.anchor is not None and self.algorithm.samples_with_anchor

    def sampling_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights rollout samples with: the anchor for nft, else the policy's own."""
        if self.anchor is None or not self._samples_with_anchor():
            return contextlib.nullcontext()
        return self._swapped_in(self.anchor, self.anchor_version)

    def sampling_version(self) -> str:
        """The version of the weights rollout samples with (see sampling_weights)."""
        return self.anchor_version if self._samples_with_anchor() else self.policy.version

    def anchor_weights(self) -> contextlib.AbstractContextManager[None]:
        """The anchor's velocity (nft's v_old, awm's KL target); no gradient flows to it."""
        if self.anchor is None:
            raise FlowGrpoError(f"algorithm {self.config.algorithm.name!r} keeps no anchor")
        return self._swapped_in(self.anchor, self.anchor_version)

    @contextlib.contextmanager
    def _swapped_in(self, weights: dict[str, torch.Tensor], version: str) -> Iterator[None]:
        own_version = self.policy.version
        with torch.no_grad():
            backup = self._copy_of_weights()
            for name, param in self.parameters.items():
                param.copy_(weights[name])
        self.policy.version = version
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.parameters.items():
                    param.copy_(backup[name])
            self.policy.version = own_version

    def update_anchor(self) -> float:
        """After an iteration's update: anchor <- d anchor + (1 - d) weights, d from the
        schedule at the optimizer steps taken so far (the reference's order). Returns d."""
        if self.anchor is None or self.anchor_schedule is None:
            return 0.0
        decay = anchor_decay(self.anchor_schedule, self.state.optimizer_steps)
        with torch.no_grad():
            for name, param in self.parameters.items():
                self.anchor[name].lerp_(param.detach(), 1.0 - decay)
        return decay

    # -- checkpoints --------------------------------------------------------------------------

    def save(self, folder: Path) -> list[str]:
        """Write weights (+ EMA), optimizer and trainer state into `folder` (rank 0 writes;
        every rank takes part in gathering the shards). Returns the file names written."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        transformer = self.policy.transformer
        # Trainable weights only: frozen ones are dropped before the gather and the CPU copy,
        # so saving a LoRA no longer all-gathers and copies the whole base model (GBs).
        # cast: a full state dict of a module holds its (gathered) tensors alone.
        model_state = cast(
            "dict[str, torch.Tensor]",
            get_model_state_dict(transformer, options=replace(options, ignore_frozen_params=True)),
        )
        optimizer_state = get_optimizer_state_dict(transformer, self.optimizer, options=options)
        shadows = {
            folder_name: {n: _full(t).cpu() for n, t in shadow.items()}
            for folder_name, shadow in ((EMA_FOLDER, self.ema), (ANCHOR_FOLDER, self.anchor))
            if shadow is not None
        }
        if not dist_info().is_main:
            return []
        folder.mkdir(parents=True, exist_ok=True)
        weights = {weights_file(self.policy.mode): model_state}
        # Folders of their own, which load_lora_weights() reads the same way as the weights.
        for folder_name, shadow in shadows.items():
            weights[f"{folder_name}/{weights_file(self.policy.mode)}"] = shadow
        for name, state in weights.items():
            write_weights(self.policy, folder / name, self._export(state))
        files = list(weights)
        with atomic_file(folder / OPTIMIZER_STATE) as handle:
            handle.write(_optimizer_bytes(optimizer_state))
        files.append(OPTIMIZER_STATE)
        atomic_write_bytes(
            folder / TRAINER_STATE, (json.dumps(asdict(self.state), indent=2) + "\n").encode()
        )
        files.append(TRAINER_STATE)
        return files

    def _export(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Trainable weights keyed as the checkpoint's weights (peft's keys for LoRA)."""
        if self.policy.mode == "full":
            return {k: v.contiguous() for k, v in state.items()}
        from peft.utils import get_peft_model_state_dict

        lora = get_peft_model_state_dict(self.policy.transformer, state_dict=state)
        return {k: v.contiguous() for k, v in lora.items()}

    def load(self, folder: Path) -> None:
        """Optimizer and trainer state of a checkpoint (weights are the policy's business)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        path = folder / OPTIMIZER_STATE
        if not path.is_file():
            raise FlowGrpoError(f"{path} is missing: cannot resume the optimizer")
        full = _optimizer_from_file(path)
        self._check_optimizer_state(full, path)
        # A trained parameter that never had a gradient has no Adam moments, in the file as in
        # the optimizer that wrote it (Qwen-Image's last block discards its text stream, so
        # that block's to_add_out LoRA gets none): strict=False. set_optimizer_state_dict first
        # gives every parameter moments (a zero-gradient step at lr 0); those the file has none
        # for are dropped again, so the resumed run saves what the uninterrupted one saves.
        set_optimizer_state_dict(
            self.policy.transformer, self.optimizer, full,
            options=StateDictOptions(full_state_dict=True, strict=False),
        )  # fmt: skip
        for name, param in self.parameters.items():
            if name not in full["state"]:
                self.optimizer.state.pop(param, None)
        self.state = _read_trainer_state(folder / TRAINER_STATE)
        if self.ema is not None:
            self._load_shadow(self.ema, folder / EMA_FOLDER)
        if self.anchor is not None and self._load_shadow(self.anchor, folder / ANCHOR_FOLDER):
            self.track_saved_anchor(folder)

    def _check_optimizer_state(self, full: dict[str, Any], path: Path) -> None:
        """Every saved moment belongs to a trained parameter and has its shape: a file that
        passed its checksum but holds another model's state is named, not half-loaded."""
        shapes = {name: tuple(p.shape) for name, p in self.parameters.items()}
        for param, moments in full["state"].items():
            if param not in shapes:
                raise FlowGrpoError(
                    f"{path}: holds optimizer state for {param!r}, which is not a trained "
                    "weight of this model (saved for another model, LoRA rank or target list?)"
                )
            for field, value in moments.items():
                if value.dim() and tuple(value.shape) != shapes[param]:
                    raise FlowGrpoError(
                        f"{path}: `{param}.{field}` has shape {tuple(value.shape)}, the weight "
                        f"has shape {shapes[param]} (saved for another model or LoRA rank?)"
                    )

    def track_saved_anchor(self, folder: Path) -> None:
        """The anchor is the one saved in checkpoint `folder`: its version is that file's."""
        if self.anchor is not None:
            self.anchor_version = checkpoint_version(folder, self.policy.mode, ANCHOR_FOLDER)

    def _load_shadow(self, shadow: dict[str, torch.Tensor], folder: Path) -> bool:
        """Load saved EMA or anchor weights into `shadow`; False when there are none (switched
        on mid-run: the copy starts from the current weights)."""
        path = folder / weights_file(self.policy.mode)
        if not path.is_file():
            return False
        saved = read_weights(self.policy, path)
        own = self._export({n: _full(t) for n, t in shadow.items()})
        if saved.keys() != own.keys():
            raise FlowGrpoError(f"{path} does not match the model's trainable weights")
        by_export_key = dict(zip(own.keys(), shadow.keys(), strict=True))
        with torch.no_grad():
            for key, value in saved.items():
                _copy_into(shadow[by_export_key[key]], value)
        return True


# ---------------------------------------------------------------------------------------------


def _optimizer_bytes(state: dict[str, Any]) -> bytes:
    """A full optimizer state dict as safetensors: tensors under `state.<param>.<field>`, the
    param groups as JSON metadata. Unlike torch.save (which embeds a random serialization id)
    the same state always gives the same bytes, and loading it runs no pickle."""
    from safetensors.torch import save

    tensors = {
        f"state.{param}.{field}": value.contiguous()
        for param, fields in state["state"].items()
        for field, value in fields.items()
    }
    return save(tensors, metadata={"param_groups": json.dumps(state["param_groups"])})


def _optimizer_from_file(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError, safe_open

    state: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            recorded = (handle.metadata() or {}).get("param_groups")
            for key in handle.keys():  # noqa: SIM118 (safe_open has no iterator)
                param, dot, field = key.removeprefix("state.").rpartition(".")
                if not key.startswith("state.") or not dot:
                    raise FlowGrpoError(
                        f"{path}: holds the tensor {key!r}, not optimizer state "
                        "(state.PARAMETER.FIELD)"
                    )
                state.setdefault(param, {})[field] = handle.get_tensor(key)
    except SafetensorError as err:
        raise FlowGrpoError(f"{path}: {unreadable_safetensors(err)}") from None
    try:
        groups = json.loads(recorded) if recorded is not None else None
    except json.JSONDecodeError:
        groups = None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise FlowGrpoError(
            f"{path}: its `param_groups` metadata is missing or not a JSON list of objects: "
            "not an optimizer state flowgrpo wrote"
        )
    for group in groups:  # JSON turned the betas tuple into a list
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def _read_trainer_state(path: Path) -> TrainerState:
    """trainer_state.json as TrainerState: every key, of its type, or an error naming it."""
    if not path.is_file():
        raise FlowGrpoError(f"{path} is missing: cannot resume the trainer")
    try:
        saved = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FlowGrpoError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(saved, dict):
        raise FlowGrpoError(f"{path}: a JSON {type(saved).__name__}, not a JSON object")
    kinds = {f.name: type(f.default) for f in fields(TrainerState)}  # int, int, str
    unknown = sorted(set(saved) - set(kinds))
    if unknown:
        raise FlowGrpoError(f"{path}: unknown key(s) {unknown}")
    for key, kind in kinds.items():
        if not isinstance(saved.get(key), kind) or isinstance(saved.get(key), bool):
            raise FlowGrpoError(f"{path}: `{key}` is missing or not a {kind.__name__}")
    return TrainerState(**saved)


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP shards one by one (every family keeps them in ModuleLists
    named *blocks)."""
    blocks: list[torch.nn.Module] = []
    for name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks"):
            blocks.extend(child)
    if not blocks:
        raise FlowGrpoError(f"{type(module).__name__}: found no transformer blocks to shard")
    return blocks


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    if hasattr(target, "full_tensor"):  # a DTensor shard: keep only this rank's piece
        from torch.distributed.tensor import DTensor, distribute_tensor

        shard = cast(DTensor, target)  # cast: of the tensors here only a DTensor has full_tensor
        value = distribute_tensor(value.to(target.dtype), shard.device_mesh, shard.placements)
        target.copy_(value)
    else:
        target.copy_(value.to(target.dtype))


class _SwapTransformer:
    """Full mode: run the adapter's velocity with the frozen reference transformer (adapters
    call `self.pipeline.transformer`, so swapping the pipeline's component is enough)."""

    def __init__(self, adapter: Any, reference: torch.nn.Module):
        self.pipeline = adapter.pipeline
        self.reference = reference

    def __enter__(self) -> None:
        self._own = self.pipeline.transformer
        self.pipeline.transformer = self.reference

    def __exit__(self, *exc: object) -> None:
        self.pipeline.transformer = self._own
