"""7. What a forward-process algorithm saves in rollout: nft (or awm) stores the clean latent
alone, flow_grpo the states around every stochastic step and their log-probs.

A: `stages.rollout.run` for iteration 0 of the shared tiny run (32 images, the same SDE
   sampler and seeds) with algorithm.name = "nft"; B: the same with "flow_grpo". Both sample
   the same images (the stored clean latent is flow_grpo's last state; tests check it), so the
   time ratio is what writing fewer rows' worth of latents saves, and the bytes per image are
   what each keeps on disk per iteration.
"""

from __future__ import annotations

from benchmarks.common import (
    SHARED_OVERRIDES,
    Context,
    Report,
    Row,
    Side,
    alternate,
    engine_for,
    fmt_s,
    make_run,
    remove,
)


def run(ctx: Context, report: Report, shared: dict) -> None:
    from flowgrpo_cli.stages import rollout

    from flowgrpo_cli.store.rundir import ROLLOUT

    runs = {}
    for name in ("nft", "flow_grpo"):
        overrides = (*SHARED_OVERRIDES, f"algorithm.name={name}")
        runs[name] = make_run(ctx.workdir / f"algo-{name}", ctx.model(), *overrides)
    config, _ = runs["flow_grpo"]
    engine = engine_for(ctx.policy(config), config)  # one policy: the same weights sample both

    def side(name: str) -> Side:
        config, run_dir = runs[name]
        return Side(
            lambda: rollout.run(config, run_dir, 0, engine),
            reset=lambda: remove(run_dir.stage_dir(0, ROLLOUT)),
        )

    timings = alternate({name: side(name) for name in runs}, ctx.reps)
    per_image = {}
    for name, (config, run_dir) in runs.items():
        if not (run_dir.stage_dir(0, ROLLOUT) / "manifest.json").exists():
            rollout.run(config, run_dir, 0, engine)
        folder = run_dir.stage_dir(0, ROLLOUT)
        images = config.algorithm.prompts_per_iteration * config.algorithm.group_size
        per_image[name] = sum(p.stat().st_size for p in folder.glob("part-*.arrow")) / images
    steps = runs["flow_grpo"][0].sampler.num_steps
    report.rows.append(
        Row(
            "7. rollout for nft (clean latent only) vs flow_grpo (trajectory)",
            fmt_s(timings.median("nft")),
            fmt_s(timings.median("flow_grpo")),
            timings.ratio_text("nft", "flow_grpo"),
            "-",
            "-",
            f"{per_image['nft'] / 1024:.1f} KiB vs {per_image['flow_grpo'] / 1024:.1f} KiB per "
            f"image on disk ({per_image['flow_grpo'] / per_image['nft']:.1f}x; {steps} steps, "
            "64x64 with its PNG: at SD3.5-M's 10 steps of 16x64x64 latents, 2.9 MB -> 0.26 MB "
            f"plus the PNG); same images and seeds; {ctx.reps} rounds",
        )
    )
