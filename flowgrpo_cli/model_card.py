"""The model card (README.md) of an exported folder: what the weights are, how they were trained
and evaluated, and everything needed to redraw an evaluation image in plain diffusers (base
model, sampler settings, the seed rule and the initial noise), with no absolute local path.
An editing run's card calls the pipeline with `image=` and ships the source image its code
edits (`card_files`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.config import Config
from flowgrpo_cli.store.rundir import RunDir, read_manifest

CONFIG_COPY = "flowgrpo_config.toml"  # the run's config, copied beside the weights


def model_card(
    config: Config, run: RunDir, iteration: int, *, ema: bool, merged: bool, command: str
) -> str:
    """README.md for the exported folder: what it is, how it was trained and scored, how to
    load it, and what it takes to redraw an evaluation image in plain diffusers.

    No absolute path goes into the card: a local base model is named by its folder's name.
    Hub metadata names the base model only when it is a hub id."""
    from flowgrpo_cli import __version__

    base = BaseModelInfo.read(config.model.path)
    requests = _eval_requests(config, run)
    edits = _edits(requests)
    task = "image-to-image" if edits else "text-to-image"
    tags = ["flowgrpo", config.algorithm.name, task, "diffusers"]
    if not merged:
        tags.append("lora")
    front = ["---", "library_name: diffusers", *base.license_front_matter()]
    if not base.local:
        front.append(f"base_model: {base.name}")
    front += ["tags:", *(f"- {tag}" for tag in tags), "---"]
    from flowgrpo_cli.reporting.render import checkpoint_name, updates

    weights = "the EMA of the trained weights" if ema else "the trained weights"
    what = "A full pipeline with" if merged else "A LoRA adapter holding"
    lines = [
        *front,
        "",
        f"# {run.root.name}, {checkpoint_name(iteration)}",
        "",
        f"{what} {weights} of {checkpoint_name(iteration)}: the policy after "
        f"{updates(iteration + 1)} (iterations 0 to {iteration}) of a "
        f"flowgrpo {__version__} run: algorithm `{config.algorithm.name}`, reward "
        f"{_rewards(config)}, train.mode `{config.train.mode}`, base model {base.described()}.",
        "",
        base.license_sentence(),
        "",
        *_eval_lines(run, iteration + 1, ema=ema),
        "## Use",
        "",
        "```python",
        "import torch",
        "from diffusers import DiffusionPipeline",
        *(["from diffusers.utils import load_image"] if edits else []),
        "",
        *_load_lines(config, base, merged),
        *_edit_usage_lines(edits),
        "```",
        "",
        *_reproduce_lines(config, run, iteration, base, requests, ema=ema, merged=merged),
        "## Made with",
        "",
        f"`{_shown_command(command)}`" if command else "flowgrpo export",
        "",
        f"The run's config is `{CONFIG_COPY}`.",
        "",
    ]
    return "\n".join(lines)


def card_files(config: Config, run: RunDir) -> dict[str, bytes]:
    """Files the card's code reads, written beside it: an editing run's source image of test
    prompt 0, the PNG the run stored (`<sample id>-source.png`); none for text-to-image."""
    requests = _eval_requests(config, run)
    if not requests or requests[0].source_image is None:
        return {}
    return {_source_file(requests[0].sample_id): requests[0].source_image}


def _source_file(sample_id: str) -> str:
    return f"{sample_id}-source.png"


def _edits(requests: list[Any]) -> bool:
    """Whether the run edits source images: its test prompts carry them (an editing data set,
    which only a family that takes a source image trains on)."""
    return any(request.source_image is not None for request in requests)


def _edit_usage_lines(edits: bool) -> list[str]:
    if not edits:
        return []
    return [
        "",
        'source = load_image("photo.png")  # the image to edit',
        'image = pipe(image=source, prompt="make the sky red").images[0]',
    ]


def _rewards(config: Config) -> str:
    return ", ".join(f"`{name}` x {weight:g}" for name, weight in config.reward.weights.items())


def _shown_command(command: str) -> str:
    """The export command with each absolute path shown by its last part: the card is made to
    be published, and the folders of the machine that wrote it are nobody else's business."""
    import shlex

    try:
        words = shlex.split(command)
    except ValueError:
        return command
    shown = [Path(word).name if os.path.isabs(word) else word for word in words]
    return shlex.join(shown)


@dataclass(frozen=True)
class BaseModelInfo:
    """What the card says of the base model: its name (a hub id, or a local folder's name:
    never the folder's path) and what its files tell, read from the folder or the local hub
    cache (never the network): pipeline family, latent shape and licence. Any of those may be
    unknown; the card then says less."""

    name: str
    local: bool
    family: str | None
    guidance_embeds: bool | None  # FLUX.1-dev: the transformer takes the guidance scale as input
    latent_channels: int | None
    vae_scale_factor: int | None
    scheduler: str | None
    license: dict[str, str]  # license (and license_name, license_link) of the base's card

    @classmethod
    def read(cls, path: str) -> BaseModelInfo:
        from flowgrpo_cli.models import family_of
        from flowgrpo_cli.planning.architectures import latent_channels, vae_scale_factor

        folder = Path(path).expanduser()
        local = folder.exists()
        name = Path(os.path.abspath(folder)).name if local else path

        def json_file(file: str) -> dict[str, Any]:
            found = _base_file(folder if local else None, path, file)
            try:
                data = json.loads(found.read_text()) if found else {}
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return {}
            return data if isinstance(data, dict) else {}

        index = json_file("model_index.json")
        try:
            family: str | None = family_of(str(index.get("_class_name")))
        except FlowGrpoError:
            family = None
        transformer = json_file("transformer/config.json")
        vae = json_file("vae/config.json")
        channels = (
            latent_channels(family, transformer)
            if family is not None and isinstance(transformer.get("in_channels"), int)
            else None
        )
        factor = vae_scale_factor(vae) if family is not None else None
        scheduler = json_file("scheduler/scheduler_config.json").get("_class_name")
        readme = _base_file(folder if local else None, path, "README.md")
        license = _front_matter_license(readme) if readme else {}
        if "license" not in license and isinstance(index.get("license"), str):
            license = {"license": index["license"]}
        embeds = transformer.get("guidance_embeds") if transformer else None
        return cls(
            name=name,
            local=local,
            family=family,
            guidance_embeds=None if embeds is None else bool(embeds),
            latent_channels=channels,
            vae_scale_factor=factor,
            scheduler=scheduler if isinstance(scheduler, str) else None,
            license=license,
        )

    def described(self) -> str:
        if self.local:
            return f"`{self.name}` (a local folder of that name, not a hub id)"
        return f"`{self.name}`"

    def license_front_matter(self) -> list[str]:
        if "license" not in self.license:
            return ["license: other"]
        return [f"{key}: {value}" for key, value in self.license.items()]

    def license_sentence(self) -> str:
        if "license" in self.license:
            return (
                f"Licence: `{self.license['license']}`, the base model's (copied from its card); "
                "its terms apply to these weights."
            )
        return (
            "Licence: the base model's licence applies to these weights (flowgrpo found none "
            "in the base model's files to copy here, hence `license: other`)."
        )


def _base_file(folder: Path | None, hub_id: str, file: str) -> Path | None:
    """`file` of the base model: in its local folder, or in the local hub cache."""
    if folder is not None:
        path = folder / file
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(hub_id, file)
    except Exception:  # not a valid repo id, no hub client: nothing cached to read
        return None
    return Path(found) if isinstance(found, str) else None


def _front_matter_license(readme: Path) -> dict[str, str]:
    """license, license_name and license_link of a model card's YAML front matter."""
    try:
        text = readme.read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    found = {}
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, sep, value = line.partition(":")
        value = value.strip().strip("'\"")
        if sep and key in ("license", "license_name", "license_link") and value:
            found[key] = value
    return found if "license" in found else {}


def _load_lines(config: Config, base: BaseModelInfo, merged: bool) -> list[str]:
    """Loading the exported weights in plain diffusers."""
    dtype = f"dtype=torch.{config.model.dtype}"
    if merged:
        return [f'pipe = DiffusionPipeline.from_pretrained("THIS_FOLDER_OR_REPO", {dtype})']
    where = "  # the base model" + (": a local folder, give your copy's path" if base.local else "")
    return [
        f'pipe = DiffusionPipeline.from_pretrained("{base.name}", {dtype}){where}',
        'pipe.load_lora_weights("THIS_FOLDER_OR_REPO")  # rank and alpha come from the file',
    ]


# Test prompts listed with their seeds in the card.
CARD_SEEDS = 4


def _reproduce_lines(
    config: Config,
    run: RunDir,
    iteration: int,
    base: BaseModelInfo,
    requests: list[Any],
    *,
    ema: bool,
    merged: bool,
) -> list[str]:
    """How the evaluation drew its images, and the plain diffusers code that redraws one.

    The evaluation (stages/evaluate.py) samples the ODE (noise level 0) on the pipeline's own
    schedule with eval.ode_solver's steps (Euler's, as the pipeline's `__call__`, unless
    dpm++2m: the card then says its code takes other steps), with eval.num_steps and
    eval.guidance_scale at model.height x model.width;
    test prompt i's initial noise comes from a CPU generator seeded with
    derive_seed(run.seed, "eval", i), drawn as the pipelines' prepare_latents draw it. An
    editing run's code hands the pipeline test prompt 0's source image (`card_files`)."""
    from flowgrpo_cli.reporting.render import checkpoint_name, updates

    evaluated = iteration + 1
    section = ["## Reproduce an evaluation image", ""]
    found = _eval_reward(run, evaluated) is not None
    # Which weights the run evaluates: the eval manifest says, else the config (the loop
    # evaluates the EMA when the run keeps one).
    evaluated_ema = _evaluated_ema(run, evaluated) if found else config.train.ema_decay > 0
    where = f"eval/iter-{evaluated:06d}"
    if found and evaluated_ema == ema:
        section.append(
            f"The run's held-out evaluation of these weights ({where} in the run folder, one "
            "PNG per test prompt) drew its images with the settings below; the code after them "
            "redraws the image of test prompt 0 in plain diffusers."
        )
    elif found:
        section.append(
            f"The run evaluated the {'EMA' if evaluated_ema else 'plain'} weights, not "
            f"these ({where}); the settings below are the evaluation's, and the "
            "code after them draws what these weights give for test prompt 0 with them."
        )
    else:
        section.append(
            f"No evaluation of the policy after {updates(evaluated)} was run; the settings "
            "below are those the run's evaluations use (config [eval]), and the code after "
            "them draws what these weights give for test prompt 0 with them."
        )
    guidance = config.eval.guidance_scale
    steps, height, width = config.eval.num_steps, config.model.height, config.model.width
    length = config.model.max_sequence_length
    exported = "the EMA of the trained weights" if ema else "the trained weights (not the EMA)"
    exported += ", fused into the base pipeline" if merged else ", as a LoRA adapter"
    evaluated_weights = (
        "the EMA of the trained weights" if evaluated_ema else "the trained weights (not the EMA)"
    )
    euler = config.eval.ode_solver == "euler"
    precision = f"`{config.model.dtype}` (model.dtype: the transformer, text encoders and VAE)"
    precision += f"; the latents and the {'Euler' if euler else 'DPM-Solver++'} steps in float32"
    if config.train.mixed_precision != "none":
        precision += "; the transformer's forwards under bfloat16 autocast (mixed_precision)"
    noise = (
        f"`torch.randn({_noise_shape(base, height, width)}, "
        'generator=torch.Generator("cpu").manual_seed(seed_i), dtype=torch.float32)`, drawn on '
        "the CPU and then moved to the model's device (shape [1, C, height / f, width / f]: C "
        "latent channels, f the VAE's downscale factor): what diffusers' `prepare_latents` "
        "draws when the pipeline is given that CPU generator"
    )
    if base.family in ("qwenimage", "qwenimage_edit"):
        noise += " (Qwen-Image's pipelines draw it as [1, 1, C, h, w]: the same numbers)"
    section += [
        "",
        f"- weights exported: {exported} of {checkpoint_name(iteration)}",
        f"- weights the run evaluates: {evaluated_weights}",
        f"- base model: {base.described()}",
        f"- reward: {_rewards(config)}",
        _sampler_line(config, base),
        f"- steps: `num_inference_steps = {steps}`",
        f"- guidance: `guidance_scale = {guidance:g}`: {_guidance_note(base, guidance)}",
        f"- size: `height = {height}`, `width = {width}`",
        f"- dtype: {precision}",
        f"- max_sequence_length: {f'`{length}`' if length else 'the pipeline default'}",
        "- seeds: test prompt i (0-based, in the order of the run's test split "
        f"data/test.parquet; eval.num_prompts = {config.eval.num_prompts or 'all'}) has the "
        "seed",
        "",
        "```python",
        "import hashlib",
        "",
        f"run_seed = {config.run.seed}  # run.seed",
        'seed_i = int.from_bytes(hashlib.sha256(f"{run_seed}/eval/{i}".encode()).digest()[:8], '
        '"little") >> 1',
        "```",
        "",
        f"- initial noise: {noise}",
        "",
    ]
    if requests:
        section += ["| i | sample | seed | prompt | negative prompt |", "|---|---|---|---|---|"]
        for i, request in enumerate(requests[:CARD_SEEDS]):
            section.append(
                f"| {i} | `{request.sample_id}` | {request.seed} | {_cell(request.prompt)} | "
                f"{_cell(request.negative_prompt) or '(none)'} |"
            )
        section.append("")
    first = requests[0] if requests else None
    if first is not None:
        prompt = f"prompt = {first.prompt!r}  # test prompt 0"
        seed = f"seed = {first.seed}  # its seed (seed_i, i = 0)"
    else:
        prompt, seed = 'prompt = "..."  # a test prompt', "seed = ...  # its seed_i"
    source: list[str] = []
    if first is not None and first.source_image is not None:
        name = _source_file(first.sample_id)
        section += [
            f"- source image: each test prompt edits its own (data/test.parquet, column "
            f"`source_image`: the input image made upright RGB PNG); test prompt 0's is "
            f"`{name}` in this folder. The pipeline resizes it itself, as the evaluation did.",
            "",
        ]
        source = [f'source = Image.open("{name}")  # its source image, a file of this folder']
    section += [
        "```python",
        "import torch",
        "from diffusers import DiffusionPipeline",
        *(["from PIL import Image"] if source else []),
        "",
        *_load_lines(config, base, merged),
        'pipe.to("cuda" if torch.cuda.is_available() else "cpu")',
        "",
        prompt,
        seed,
        *source,
        "image = pipe(",
        *(["    image=source,"] if source else []),
        "    prompt=prompt,",
        *_guidance_arguments(base, guidance, first.negative_prompt if first else ""),
        f"    num_inference_steps={steps},",
        f"    height={height},",
        f"    width={width},",
        # FluxKontextPipeline scales height x width to max_area (1 MP unless given): this keeps
        # it at the size the run generated at.
        *([f"    max_area={height * width},"] if base.family == "flux_kontext" else []),
        *([f"    max_sequence_length={length},"] if length else []),
        '    generator=torch.Generator("cpu").manual_seed(seed),',
        ").images[0]",
        f'image.save("{first.sample_id if first else "eval"}.png")',
        "```",
        "",
        _tolerance_note(config),
        "",
    ]
    if first is not None and first.system_prompt:
        section += [
            "The evaluation encoded the prompts with a system prompt (data.system_prompt or the "
            "row's own), which the pipeline's own chat template does not have: this code does "
            "not redraw those images exactly.",
            "",
        ]
    return section


def _eval_requests(config: Config, run: RunDir) -> list[Any]:
    """The evaluation's test prompts and seeds, as stages/evaluate.py draws them; [] when the
    run's data cannot be read (the card then leaves the list out)."""
    from flowgrpo_cli.stages.evaluate import evaluation_requests

    try:
        return evaluation_requests(config, run)
    except (FlowGrpoError, OSError):
        return []


def _cell(text: str) -> str:
    """Text in a Markdown table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _noise_shape(base: BaseModelInfo, height: int, width: int) -> str:
    if base.latent_channels is None or base.vae_scale_factor is None:
        return "(1, C, height // f, width // f)"  # C latent channels, f the VAE's downscale
    f = base.vae_scale_factor
    return f"(1, {base.latent_channels}, {height // f}, {width // f})"


def _guidance_note(base: BaseModelInfo, guidance: float) -> str:
    if guidance <= 1.0:
        return "1: no classifier-free guidance"
    if base.guidance_embeds:
        return "embedded guidance (FLUX.1-dev's), one forward a step: the pipeline's guidance_scale"
    if base.family not in (None, "sd3"):
        return (
            "true classifier-free guidance against the negative prompt: the pipeline's "
            '`true_cfg_scale`, which needs a `negative_prompt` ("" when the row has none)'
        )
    if base.family == "sd3":
        return 'classifier-free guidance against the negative prompt ("" when the row has none)'
    return "classifier-free guidance, as the pipeline's own guidance argument"


def _guidance_arguments(base: BaseModelInfo, guidance: float, negative: str) -> list[str]:
    """The pipeline's guidance arguments: SD3's guidance_scale, a transformer's embedded
    guidance (FLUX.1-dev), else true CFG (`true_cfg_scale`, FLUX and the Qwen-Image families)."""
    if base.family not in (None, "sd3") and not base.guidance_embeds:
        if guidance <= 1.0:
            return []
        return [f"    true_cfg_scale={guidance!r},", f"    negative_prompt={negative!r},"]
    lines = [f"    guidance_scale={guidance!r},"]
    if base.family == "sd3" and negative and guidance > 1.0:
        lines.append(f"    negative_prompt={negative!r},")
    return lines


def _sampler_line(config: Config, base: BaseModelInfo) -> str:
    scheduler = f"`{base.scheduler or 'its scheduler_config.json'}`"
    if config.eval.ode_solver == "euler":
        return (
            "- sampler: noise level 0, i.e. the ODE: plain Euler steps on the schedule of the "
            f"base's own scheduler ({scheduler}), exactly as the pipeline's `__call__` steps"
        )
    return (
        "- sampler: noise level 0, i.e. the ODE, on the schedule of the base's own scheduler "
        f"({scheduler}), taken with the multistep DPM-Solver++ of order 2 (eval.ode_solver = "
        f"`{config.eval.ode_solver}`), which the pipeline's `__call__` does not take: it steps "
        "with Euler"
    )


def _tolerance_note(config: Config) -> str:
    if config.eval.ode_solver != "euler":
        return (
            "The evaluation took DPM-Solver++ (2M) steps (eval.ode_solver) where this code "
            "takes the pipeline's Euler steps along the same sigmas from the same noise: both "
            "solve the same ODE, so expect an image close to the evaluation's, but not equal "
            "(the two solvers' discretisation errors differ, more so with few steps)."
        )
    close = (
        "expect an image close to the evaluation's but not identical (a few levels out of 255 "
        "in places)"
    )
    if config.train.mixed_precision != "none":
        return (
            "The evaluation ran the transformer under bfloat16 autocast "
            f"(train.mixed_precision), which a plain diffusers pipeline does not: {close}."
        )
    if config.model.dtype == "float32":
        return (
            "In float32, on the kind of device the run evaluated on, the image matches the "
            "run's evaluation image to within about 1/255 per pixel (rounding to 8 bits); on "
            "another device (CPU vs GPU, another GPU) expect small differences."
        )
    return (
        f"The evaluation ran the model in {config.model.dtype} with float32 latents; a "
        f"diffusers pipeline loaded in {config.model.dtype} keeps its latents in "
        f"{config.model.dtype} between steps, so {close}."
    )


def _eval_lines(run: RunDir, evaluated: int, *, ema: bool) -> list[str]:
    """The held-out evaluation of these weights beside the base's, when the run made them.

    The loop evaluates the EMA weights when the run keeps an EMA: that number is the EMA
    export's, never the plain weights' (eval/iter-M's manifest records which were evaluated)."""
    from flowgrpo_cli.reporting.render import checkpoint_name, updates

    found = {n: _eval_reward(run, n) for n in (0, evaluated)}
    after = f"after {updates(evaluated)} ({checkpoint_name(evaluated - 1)})"
    if found[evaluated] is None:
        return [f"No held-out evaluation was run of the policy {after}.", ""]
    evaluated_ema = _evaluated_ema(run, evaluated)
    if evaluated_ema != ema:
        other = "the EMA of the weights" if evaluated_ema else "the plain weights"
        export = "`flowgrpo export --ema`" if evaluated_ema else "`flowgrpo export` without --ema"
        return [
            f"Held-out evaluation: these weights were not evaluated. The run evaluated {other} "
            f"{after}: eval/reward_mean {found[evaluated]:.4f} (exported by {export}).",
            "",
        ]
    base = "not evaluated" if found[0] is None else f"{found[0]:.4f}"
    return [
        "| held-out reward (eval/reward_mean) | value |",
        "|---|---|",
        f"| base model | {base} |",
        f"| {after} | {found[evaluated]:.4f} |",
        "",
    ]


def _evaluated_ema(run: RunDir, iteration: int) -> bool:
    """Whether eval/iter-N evaluated EMA weights: its policy version ends in `+ema`."""
    identity = (read_manifest(run.eval_dir(iteration)) or {}).get("identity")
    policy = identity.get("policy") if isinstance(identity, dict) else None
    return isinstance(policy, str) and policy.endswith("+ema")


def _eval_reward(run: RunDir, iteration: int) -> float | None:
    path = run.eval_dir(iteration) / "metrics.json"
    if not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FlowGrpoError(f"{path}: not valid JSON ({err})") from None
    value = metrics.get("eval/reward_mean") if isinstance(metrics, dict) else None
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise FlowGrpoError(f"{path}: `eval/reward_mean` is {value!r}, not a number")
    return float(value) if value is not None else None
