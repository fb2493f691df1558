"""7. What a forward-process algorithm saves in rollout: nft (or awm) stores the clean latent
alone, flow_grpo the states around every stochastic step and their log-probs.

A: `stages.rollout.run` for iteration 0 of the shared tiny run (32 images, the same SDE
   sampler and seeds) with algorithm.name = "nft"; B: the same with "flow_grpo". Both sample
   the same images (the stored clean latent is flow_grpo's last state; tests check it), so the
   time ratio is what writing fewer rows' worth of latents saves, and the bytes per image are
   what each keeps on disk per iteration.

7b. What MixGRPO-Flash saves in rollout: the same mixgrpo run (20 steps, a 2-step SDE window at
   its first position) with the steps after the window taken by DPM-Solver++ (2M) on a
   schedule compressed to 0.4 of them (A), against Euler on every step (B). The window's
   states and log-probs are the same (tests check it); the images are not.
"""

from __future__ import annotations

from benchmarks.common import (
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
        overrides = (*ctx.shared_overrides, f"algorithm.name={name}")
        runs[name] = make_run(ctx.workdir / f"algo-{name}", ctx.model(), *overrides)
    config, _ = runs["flow_grpo"]
    engine = engine_for(ctx.policy(config), config)  # one policy: the same weights sample both

    timings = _time_rollouts(runs, engine, ctx.reps)
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
    _flash_rollout(ctx, report, engine)


def _time_rollouts(runs: dict, engine, reps: int):
    """Iteration 0's rollout of each (config, run) in `runs`, timed in alternation."""
    from flowgrpo_cli.stages import rollout
    from flowgrpo_cli.store.rundir import ROLLOUT

    def side(name: str) -> Side:
        config, run_dir = runs[name]
        return Side(
            lambda: rollout.run(config, run_dir, 0, engine),
            reset=lambda: remove(run_dir.stage_dir(0, ROLLOUT)),
        )

    return alternate({name: side(name) for name in runs}, reps)


def _flash_rollout(ctx: Context, report: Report, engine) -> None:
    window = ("algorithm.name=mixgrpo", "sampler.num_steps=20", "sampler.window_size=2")
    flash = ("sampler.post_window_solver=dpm++2m", "sampler.post_window_compress=0.4")
    runs = {
        "flash": make_run(ctx.workdir / "algo-flash", ctx.model(), *ctx.shared_overrides, *window,
                          *flash),
        "euler": make_run(ctx.workdir / "algo-euler", ctx.model(), *ctx.shared_overrides, *window),
    }  # fmt: skip
    timings = _time_rollouts(runs, engine, ctx.reps)
    # Window 0-1 of 20 steps: int((20 - 1) 0.4) = 7 points, 6 steps after it, against 18.
    report.rows.append(
        Row(
            "7b. mixgrpo rollout: MixGRPO-Flash (DPM-Solver++ 2M, compress 0.4) vs Euler",
            fmt_s(timings.median("flash")),
            fmt_s(timings.median("euler")),
            timings.ratio_text("flash", "euler"),
            "-",
            "-",
            "32 images, 20 steps, SDE window of 2 at step 0; 8 vs 20 transformer calls per "
            f"image (CFG batched); same seeds and window; {ctx.reps} rounds",
        )
    )
