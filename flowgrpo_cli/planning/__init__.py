"""`flowgrpo plan`: memory per device, disk and transformer passes of a run, before anything
is loaded or downloaded.

    plan = plan_run(config, iterations=1000)
    plan.memory["update"].total_bytes      # peak bytes on each device during the update
    plan.disk_per_iteration_bytes, plan.disk_total_bytes
    plan.passes["rollout"].forwards         # transformer forwards per iteration (all ranks)
    plan.summary_lines()

The architecture comes from config.json files on the meta device (planning.architectures);
memory per stage follows what the code keeps resident (planning.memory), disk what each stage
writes (planning.disk). Nothing here imports torch until a plan is made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flowgrpo_cli.planning.memory import StageMemory
from flowgrpo_cli.store.config import Config

__all__ = ["Passes", "RunPlan", "StageMemory", "plan_run"]


@dataclass(frozen=True)
class Passes:
    """One stage's work per iteration, over all ranks: images made (or samples trained) and
    transformer passes counted per sequence (a CFG batch [uncond; cond] of B images is 2B;
    true CFG's second forward counts too)."""

    images: int
    forwards: int
    backwards: int
    note: str

    def per_gpu(self, nproc: int) -> dict[str, float]:
        return {k: getattr(self, k) / nproc for k in ("images", "forwards", "backwards")}


@dataclass
class RunPlan:
    config_summary: str
    architecture: str
    nproc: int
    iterations: int
    memory: dict[str, Any]  # stage -> StageMemory (per device)
    disk_per_iteration: list[tuple[str, int]]
    disk_total: list[tuple[str, int]]
    passes: dict[str, Passes]  # per iteration, all ranks; evaluate: one evaluation
    evaluations: int  # evaluations in the run
    parameters: dict[str, int]  # component -> parameters; "trained" -> trained parameters
    notes: list[str] = field(default_factory=list)

    @property
    def disk_per_iteration_bytes(self) -> int:
        return sum(size for _, size in self.disk_per_iteration)

    @property
    def disk_total_bytes(self) -> int:
        return sum(size for _, size in self.disk_total)

    @property
    def peak_stage(self) -> str:
        return max(self.memory, key=lambda stage: self.memory[stage].total_bytes)

    def summary_lines(self) -> list[str]:
        from flowgrpo_cli.reporting.render import format_bytes

        peak = self.peak_stage
        per_stage = ", ".join(
            f"{stage} {format_bytes(m.total_bytes)}" for stage, m in self.memory.items()
        )
        rollout, update = self.passes["rollout"], self.passes["update"]
        return [
            f"plan ({self.architecture}): memory per device at most "
            f"{format_bytes(self.memory[peak].total_bytes)} ({peak}; {per_stage}; "
            f"{self.nproc} process(es))",
            f"disk: {format_bytes(self.disk_per_iteration_bytes)} per iteration, "
            f"{format_bytes(self.disk_total_bytes)} for {self.iterations} iterations under "
            "run.keep_trajectories / keep_checkpoints",
            f"per iteration: {rollout.images} images, {rollout.forwards:,} rollout + "
            f"{update.forwards:,} update transformer forwards, {update.backwards:,} backwards "
            "(all ranks)",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "config": self.config_summary,
            "nproc": self.nproc,
            "iterations": self.iterations,
            "memory": {
                stage: {"total_bytes": m.total_bytes, "items": [list(i) for i in m.items]}
                for stage, m in self.memory.items()
            },
            "peak_stage": self.peak_stage,
            "disk_per_iteration_bytes": self.disk_per_iteration_bytes,
            "disk_per_iteration": [list(i) for i in self.disk_per_iteration],
            "disk_total_bytes": self.disk_total_bytes,
            "disk_total": [list(i) for i in self.disk_total],
            "passes": {stage: asdict(p) for stage, p in self.passes.items()},
            "evaluations": self.evaluations,
            "parameters": self.parameters,
            "notes": self.notes,
        }


def plan_run(config: Config, *, iterations: int = 1000, arch: str | None = None) -> RunPlan:
    """The plan of `iterations` iterations of `flowgrpo loop` with `config`: no weights are
    read and nothing is downloaded (arch: a published architecture's name or a local folder,
    instead of model.path)."""
    from flowgrpo_cli.planning.architectures import resolve_architecture
    from flowgrpo_cli.planning.disk import disk_items
    from flowgrpo_cli.planning.memory import shapes, stage_memory

    architecture = resolve_architecture(config.model.path, arch)
    s = shapes(config, architecture)
    memory = stage_memory(config, architecture, s)
    items, notes = disk_items(config, architecture, s, iterations)
    passes, evaluations = _passes(config, architecture, iterations)
    parameters = {n: c.parameters for n, c in architecture.components.items()}
    parameters["trained"] = s.trained
    notes = [f"text conditioning: {s.text_note}", *notes]
    if config.distributed.nproc > 1 and config.algorithm.recompute_old_logprobs:
        notes.append("recompute_old_logprobs: every rank recomputes every sample's steps")
    return RunPlan(
        config_summary=(
            f"{config.model.height}x{config.model.width}, {config.model.dtype}, "
            f"{config.algorithm.name}, train.mode {config.train.mode}"
        ),
        architecture=f"{architecture.name} ({architecture.family})",
        nproc=config.distributed.nproc,
        iterations=iterations,
        memory=memory,
        disk_per_iteration=[(i.label, i.per_iteration) for i in items],
        disk_total=[(i.label, i.run_total) for i in items],
        passes=passes,
        evaluations=evaluations,
        parameters=parameters,
        notes=notes,
    )


def _sampling_steps(config: Config) -> int:
    """Denoising steps a rollout image takes (fewer after the SDE window with
    sampler.post_window_compress < 1, as engines.sampling._step_sigmas draws them)."""
    from flowgrpo_cli.training.algorithms import algorithm_for

    sampler = config.sampler
    if sampler.post_window_compress >= 1.0 or not sampler.window_size:
        return sampler.num_steps
    stochastic = algorithm_for(config).step_schedule(0).stochastic
    end = max(i for i, s in enumerate(stochastic) if s)
    remaining = sampler.num_steps - 1 - end
    if remaining < 1:
        return sampler.num_steps
    points = max(int(max((remaining + 1) * sampler.post_window_compress, 1)), 2)
    return end + 1 + points - 1


def _passes(config: Config, arch: Any, iterations: int) -> tuple[dict[str, Passes], int]:
    from flowgrpo_cli.planning.memory import cfg_layout, evaluation_prompts
    from flowgrpo_cli.training.algorithms import algorithm_for

    algorithm = config.algorithm
    images = algorithm.group_size * algorithm.prompts_per_iteration
    per_forward, forwards = cfg_layout(arch, config.sampler.guidance_scale)
    cfg = per_forward * forwards
    steps = _sampling_steps(config)
    rollout = Passes(
        images, images * steps * cfg, 0, f"{steps} steps x CFG factor {cfg}, {images} VAE decodes"
    )
    method = algorithm_for(config)
    t_per_forward, t_forwards = cfg_layout(
        arch, method.trained_guidance(config.sampler.guidance_scale, arch.guidance_embeds)
    )
    t_cfg = t_per_forward * t_forwards
    epochs = config.train.inner_epochs
    trained, terms = method.trained_terms()
    no_grad = method.no_grad_forwards()
    recompute = 0
    if method.needs_trajectory and algorithm.recompute_old_logprobs:
        recompute = images * trained * t_cfg
    unit = images * trained * t_cfg * epochs
    note = f"{trained} {terms} per image x CFG factor {t_cfg} x {epochs} epoch(s)"
    for forward in no_grad:
        note += f", + {forward} forward"
    if recompute:
        note += f", + {recompute:,} old-log-prob forwards on every rank"
    note += "; at most: samples with advantage 0 are dropped"
    update = Passes(images * epochs, unit * (1 + len(no_grad)) + recompute, unit, note)
    e_per_forward, e_forwards = cfg_layout(arch, config.eval.guidance_scale)
    prompts, _ = evaluation_prompts(config)
    evaluate = Passes(
        prompts,
        prompts * config.eval.num_steps * e_per_forward * e_forwards,
        0,
        f"one evaluation, every {config.eval.every} iteration(s)"
        if config.eval.every
        else "off (eval.every = 0)",
    )
    evaluations = iterations // config.eval.every + 1 if config.eval.every else 0
    return {"rollout": rollout, "update": update, "evaluate": evaluate}, evaluations


def per_iteration_evaluate(plan: RunPlan) -> float:
    """Evaluation forwards per iteration, amortised over the run."""
    if not plan.iterations:
        return 0.0
    return plan.passes["evaluate"].forwards * plan.evaluations / plan.iterations
