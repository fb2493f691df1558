"""The typed run config: one TOML file per run, validated on load.

Each section is a dataclass whose fields carry their help text and their allowed values, so
validation, the docs' configuration reference and `flowgrpo config --reference` read from one
place. Every problem found is reported at once, each naming the key, the file and line where
it was set, and what is allowed (or the closest valid key for a typo).

Fields marked ``affects_results=False`` (process counts, worker counts, devices) may differ
between commands on the same run: they change how fast a run goes, not what it computes, so
they are left out of the config hash that manifests record.

The [reward] sections are also what the reward builders read (flowgrpo_cli.rewards): defined
here once, with their defaults (the released reward models' ids) and checks, and checked the
same way when code builds one (`_CheckedSection`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import string
import tomllib
import typing
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from flowgrpo_cli.errors import FlowGrpoError

Check = Callable[[Any], str | None]


def _option(
    default: Any,
    help: str,
    *,
    check: Check | None = None,
    path: Literal["", "local", "hub", "output"] = "",
    affects_results: bool = True,
    used_when: Callable[[Any], bool] | None = None,
    secret: bool = False,
) -> Any:
    """A config key: its default, the help the reference prints, a check of its value, and
    whether it is a path: a `local` input (stored absolute), a `hub` one (a local folder or hub
    id) or an `output` (run.dir); see `_expand_path` for what each is relative to.
    `used_when(section)` false: the key changes nothing in this config, so the hash skips it
    (a new reward's settings leave the hash of runs that do not use it alone). `secret`: a
    value that fails its check is not echoed (a key pasted where its variable's name goes)."""
    meta = {
        "help": help, "check": check, "path": path, "affects_results": affects_results,
        "used_when": used_when, "secret": secret,
    }  # fmt: skip
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be >= {low}"


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def _in_unit_interval(v: float) -> str | None:
    return None if 0.0 < v <= 1.0 else "must be in (0, 1]"


def _decay(v: float) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1) (0 turns EMA off)"


def _source_size(v: list[int]) -> str | None:
    if not v:
        return None
    if len(v) != 2 or any(not isinstance(side, int) or side < 16 for side in v):
        return "must be [] or [width, height], two whole numbers of pixels >= 16"
    return None


def _window_range(v: list[int]) -> str | None:
    if not v:
        return None
    if len(v) != 2 or v[0] < 0 or v[1] < v[0]:
        return (
            "must be [] or [lo, hi] with 0 <= lo <= hi (the window's first step is drawn from it)"
        )
    return None


@dataclass
class RunSection:
    dir: str = _option(
        "runs/default",
        "Run directory: config, data, iterations, checkpoints. Relative to the working "
        "directory (unlike input paths in a config file, which are relative to the file).",
        path="output",
        affects_results=False,
    )
    seed: int = _option(
        0,
        "Seed of everything random: prompt order, noise, dropout, splits.",
        check=lambda v: None if 0 <= v < 2**63 else "must be in [0, 2**63) (a torch seed)",
    )
    keep_trajectories: int = _option(
        2,
        "Keep the trajectory latents and conditioning of the last K finished iterations; "
        "older ones are deleted once their update is done (images, scores, metrics and "
        "checkpoints stay). -1 = keep all.",
        check=_at_least(-1),
        affects_results=False,
    )
    keep_checkpoints: int = _option(
        0,
        "Keep the weights and optimizer state of the last K checkpoints that "
        "run.checkpoint_every keeps (the latest always stays); older ones keep only their "
        "manifest. 0 = keep all of those.",
        check=_at_least(0),
        affects_results=False,
    )
    checkpoint_every: int = _option(
        10,
        "Keep the weights and optimizer state of every k-th checkpoint (iter-N with N + 1 a "
        "multiple of k: the policy after k, 2k, ... updates) and of the latest one, which "
        "resume needs; the others keep only their manifest. 1 = keep every checkpoint.",
        check=_at_least(1),
        affects_results=False,
    )


MAX_IMAGE_PIXELS = 4096 * 4096  # data.max_image_pixels' default


@dataclass
class DataSection:
    train: str = _option(
        "",
        "Training prompts (txt in the paper's OCR format, jsonl, csv or "
        "parquet with a `prompt` column).",
        path="local",
    )
    test: str = _option(
        "", "Test prompts; empty = split `test_fraction` off the train file.", path="local"
    )
    test_fraction: float = _option(
        0.1,
        "Share of train prompts held out when `test` is empty.",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)",
    )
    train_prompts: int = _option(
        0,
        "Train on only the first N training prompts (after the test split); 0 = all. "
        "A handful is the overfit check: their reward must climb within minutes.",
        check=_at_least(0),
    )
    skip_invalid: bool = _option(
        False,
        "Skip invalid prompt rows (no target, empty, not a string, not UTF-8, ...) and report "
        "how many (else an error listing them).",
    )
    negative_prompt: str = _option("", "Negative prompt for every row lacking its own.")
    system_prompt: str = _option("", "System prompt (Qwen-Image); empty = the pipeline's own.")
    max_image_pixels: int = _option(
        MAX_IMAGE_PIXELS,
        "Largest source image (width x height) an editing data set's `image` column may hold; "
        "a larger one is an invalid row.",
        check=_at_least(1),
        # At its default it leaves the hash of runs prepared before the key existed alone.
        used_when=lambda data: data.max_image_pixels != MAX_IMAGE_PIXELS,
    )
    source_size: list[int] = _option(
        [],
        "[width, height]: resize every source image of an editing data set to this size when "
        "prepare stores it (flow_grpo's edit recipes: [resolution, resolution]), so sources of "
        "any aspect ratio share a batch; [] = keep each image's own size.",
        check=_source_size,
        used_when=lambda data: bool(data.source_size),
    )


@dataclass
class ModelSection:
    path: str = _option("", "Base pipeline: a local diffusers folder or a hub id.", path="hub")
    init_lora: str = _option(
        "",
        "Start from this trained LoRA (a checkpoint or export folder, or its .safetensors "
        "file) instead of a fresh adapter; its rank and alpha must be train.lora_rank / "
        "lora_alpha. The KL reference stays the base model.",
        path="local",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _option(
        "bfloat16", "Transformer precision, the same in rollout and update; step math is float32."
    )
    device: str = _option(
        "auto", "auto (cuda when available), cpu, cuda, cuda:N.", affects_results=False
    )
    height: int = _option(512, "Image height in pixels.", check=_at_least(16))
    width: int = _option(512, "Image width in pixels.", check=_at_least(16))
    max_sequence_length: int = _option(
        0, "Text tokens for the long text encoder; 0 = the pipeline's default.", check=_at_least(0)
    )


@dataclass
class SamplerSection:
    kind: Literal["sde", "cps"] = _option("sde", "Stochastic step: the paper's SDE or CPS.")
    noise_level: float = _option(
        0.7, "Noise level a of the stochastic step (0 = Euler ODE).", check=_at_least(0.0)
    )
    num_steps: int = _option(10, "Denoising steps per rollout image.", check=_at_least(2))
    guidance_scale: float = _option(
        4.5, "CFG scale (FLUX.1-dev: the embedded guidance).", check=_at_least(1.0)
    )
    batch_size: int = _option(
        8, "Images per transformer forward in rollout.", check=_at_least(1), affects_results=False
    )
    train_fraction: float = _option(
        1.0, "Share of the trainable steps trained, first first.", check=_in_unit_interval
    )
    train_last_step: bool = _option(False, "Also train the last step (to sigma 0).")
    window_size: int = _option(
        0,
        "SDE window: only W consecutive steps stochastic and "
        "trained (Flow-GRPO-Fast / MixGRPO); 0 = every step.",
        check=_at_least(0),
    )
    window_range: list[int] = _option(
        [],
        "[lo, hi]: the window's first step, drawn per iteration (mixgrpo: where it starts and "
        "stops moving); [] = step 0 (mixgrpo: [0, num_steps - window_size - 1]).",
        check=_window_range,
    )
    window_shift_every: int = _option(
        25, "mixgrpo: iterations the window stays before it moves.", check=_at_least(1)
    )
    window_stride: int = _option(
        1, "mixgrpo: steps the window moves each time.", check=_at_least(0)
    )
    # The keys below came after runs existed: `used_when` leaves them out of the hash while
    # they hold their defaults, so those runs keep their hashes.
    window_schedule: Literal["progressive", "decay", "exp_decay"] = _option(
        "progressive",
        "mixgrpo: how long the window stays at each position: window_shift_every iterations "
        "(progressive); from window_shift_every down to window_shift_every_min as the window "
        "moves on (decay); window_shift_every * exp(-window_decay_rate * max(0, start - "
        "window_decay_threshold)), rounded up (exp_decay).",
        used_when=lambda sampler: sampler.window_schedule != "progressive",
    )
    window_shift_every_min: int = _option(
        1,
        "mixgrpo, decay: the shortest stay, reached at the last step.",
        check=_at_least(1),
        used_when=lambda sampler: sampler.window_schedule == "decay",
    )
    window_decay_threshold: int = _option(
        13,
        "mixgrpo, exp_decay: the window start after which its stays shorten.",
        check=_at_least(0),
        used_when=lambda sampler: sampler.window_schedule == "exp_decay",
    )
    window_decay_rate: float = _option(
        0.1,
        "mixgrpo, exp_decay: k of the stays' exponential decay.",
        check=_at_least(0.0),
        used_when=lambda sampler: sampler.window_schedule == "exp_decay",
    )
    ode_solver: Literal["euler", "dpm++2m"] = _option(
        "euler",
        "Solver of every deterministic step of the rollout: all of them at noise_level 0, else "
        "the ODE steps before and after the SDE window. dpm++2m: the multistep DPM-Solver++ "
        "of order 2 (DiffusionNFT's rollout). Stochastic steps stay sampler.kind's, whose "
        "log-probs are trained; refused where no step is deterministic.",
        used_when=lambda sampler: sampler.ode_solver != "euler",
    )
    post_window_solver: Literal["euler", "dpm++2m"] = _option(
        "euler",
        "ODE solver of the steps after the SDE window only (MixGRPO-Flash: dpm++2m); the steps "
        "before the window stay Euler, as theirs. ode_solver covers these steps too.",
        used_when=lambda sampler: sampler.post_window_solver != "euler",
    )
    post_window_compress: float = _option(
        1.0,
        "Share of the steps after the SDE window that are taken, redrawn on the scheduler's "
        "shifted time grid (MixGRPO-Flash: 0.4); 1 = the full schedule.",
        check=_in_unit_interval,
        used_when=lambda sampler: sampler.post_window_compress < 1.0,
    )
    # MixGRPO as its authors run it (Tencent-Hunyuan/MixGRPO, scripts/finetune/
    # finetune_flux_grpo_MixGRPO*.sh); later keys too, out of the hash at their defaults.
    window_end: Literal["stay", "shrink", "roll_back"] = _option(
        "stay",
        "mixgrpo: the window at the end of its slide. stay: it stops at window_range's hi "
        "(default num_steps - window_size - 1) and keeps its size. shrink: its steps stop "
        "before step num_steps - 2, so it shrinks once its start passes num_steps - 2 - "
        "window_size, and it stops at hi (default num_steps - 3, one step), as MixGRPO's "
        "GRPOTrainingStates without --roll_back (fastvideo/utils/grpo_states.py; it goes on "
        "to an empty window, where their update fails). roll_back: as shrink, then it "
        "restarts at window_range's lo: their scripts' --roll_back.",
        used_when=lambda sampler: sampler.window_end != "stay",
    )
    shift: float = _option(
        0.0,
        "Fixed time shift s of the sigma schedule: the scheduler's times shifted by "
        "sigma = s t / (1 + (s - 1) t), resolution-dependent shifting off (diffusers' "
        "FlowMatchEulerDiscreteScheduler with shift = s, use_dynamic_shifting = False); "
        "0 = the model's own schedule. MixGRPO's scripts: --shift 3 (train_grpo_flux.py "
        "sd3_time_shift). Rollout only; evaluation keeps the model's schedule.",
        check=_at_least(0.0),
        used_when=lambda sampler: sampler.shift != 0.0,
    )
    same_noise_per_group: bool = _option(
        False,
        "Every image of a group starts from one initial noise, seeded by (run.seed, "
        "iteration, prompt); each image keeps its own SDE noise. MixGRPO's scripts: "
        "--init_same_noise (train_grpo_flux.py sample_reference_model). Needs noise_level > 0.",
        used_when=lambda sampler: sampler.same_noise_per_group,
    )
    engine: Literal["diffusers", "vllm-omni"] = _option("diffusers", "Rollout engine.")
    merge_lora: bool = _option(
        False,
        "Rollout with the LoRA update merged into float32 base weights: faster, "
        "log-probs off by float32 rounding (diffusers engine; not in a multi-process loop).",
    )


class _CheckedSection:
    """A section that code builds too, not only load_config: the reward builders take the
    [reward] sections, and tests and the CLI build or replace them. Built with a value its
    keys' checks (or a Literal's choices) refuse, it raises the FlowGrpoError a config file's
    value gets, less the file and line."""

    TABLE: ClassVar[str]  # its dotted name in the config: "reward.remote"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        problems = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, tp = getattr(self, f.name), hints[f.name]
            if typing.get_origin(tp) is Literal:
                problem = None if value in typing.get_args(tp) else f"is not {_type_name(tp)}"
            else:
                check = f.metadata.get("check")
                problem = check(value) if check else None
            if problem:
                problems.append(f"`{self.TABLE}.{f.name}` = {value!r} {problem}")
        if problems:
            raise FlowGrpoError("; ".join(problems))


def url_problem(url: str) -> str | None:
    """What is wrong with a `remote` reward's URL (None: nothing), found before any request:
    an http(s) URL with a host, and a port, if given, in 1..65535."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises for a port that is not a number or out of range
    except ValueError as err:
        return f"not a valid URL ({err})"
    if parts.scheme not in ("http", "https"):
        return "expected an http:// or https:// URL"
    if not parts.hostname:
        return "no host: expected e.g. http://host:8000/score"
    if port == 0:
        return "port 0: give the port the server listens on"
    return None


def _remote_url(v: str) -> str | None:
    problem = url_problem(v) if v else None  # "" : no remote (or vlm) reward
    return f"is refused: {problem}" if problem else None


# What a `remote` server may say it needs beyond the images and prompts every request holds
# (rewards/base.py's `Need`): a target text, a GenEval record, a source image per image.
REMOTE_NEEDS = ("ground_truths", "geneval", "source_images")


def _remote_needs(v: list[str]) -> str | None:
    unknown = [need for need in v if need not in REMOTE_NEEDS]
    if unknown:
        return f"names {unknown[0]!r}: expected any of {', '.join(REMOTE_NEEDS)}"
    return None


@dataclass
class HttpRewardSection(_CheckedSection):
    """How a reward that asks an HTTP server waits and retries (rewards/transport.py): the
    same keys in the table of every such reward."""

    timeout_s: float = _option(
        60.0,
        "Seconds one request may take, its whole reply included (then it is retried).",
        check=_positive,
    )
    max_retries: int = _option(
        3, "Retries after a failed request (exponential backoff).", check=_at_least(0)
    )
    backoff_s: float = _option(
        1.0,
        "Seconds before the first retry; doubled for each further one.",
        check=_at_least(0.0),
        affects_results=False,
    )
    max_reply_mb: float = _option(
        16.0,
        "A larger reply is refused unread (the server is broken).",
        check=_positive,
        affects_results=False,
    )
    deadline_s: float = _option(
        600.0,
        "Seconds all requests for one batch of images may take, retries and waits between "
        "them included; then scoring stops with an error.",
        check=_positive,
        affects_results=False,
    )


@dataclass
class RemoteRewardSection(HttpRewardSection):
    """[reward.remote]: how the `remote` reward reaches its scoring server (it counts once
    `url` is set)."""

    TABLE = "reward.remote"
    url: str = _option(
        "",
        "URL the `remote` reward POSTs image batches to.",
        check=_remote_url,
    )
    batch_size: int = _option(16, "Images per request.", check=_at_least(1))
    needs: list[str] = _option(
        [],
        "What the server needs besides images and prompts: any of "
        + ", ".join(REMOTE_NEEDS)
        + "; prepare then refuses prompts without them, as for a plugin's `needs`.",
        check=_remote_needs,
        used_when=lambda remote: bool(remote.needs),
    )


TEMPLATE_FIELDS = ("prompt", "ground_truth")
VLM_TEMPLATE = (
    "Rate how well this image matches the description, from 0 (not at all) to 10 "
    "(perfectly). Reply with the number only.\nDescription: {prompt}"
)


def template_fields(template: str) -> list[str]:
    """The {placeholders} of a `vlm` prompt template, in order; ValueError if its braces are
    unbalanced."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def _vlm_template(v: str) -> str | None:
    if not v.strip():
        return "is empty: write the question the judge answers"
    try:
        fields = template_fields(v)
    except ValueError as err:
        return f"is not a template ({err}); write {{{{ and }}}} for a literal brace"
    unknown = [name for name in fields if name not in TEMPLATE_FIELDS]
    if unknown:
        known = " and ".join(f"{{{name}}}" for name in TEMPLATE_FIELDS)
        return (
            f"uses {{{unknown[0]}}}: a template knows {known}; write {{{{ and }}}} for a "
            "literal brace"
        )
    return None


def _env_name(v: str) -> str | None:
    # Upper case only, as environment variables are by convention: a pasted key (mixed case,
    # dashes) fails here, and the error does not print it (the option is `secret`).
    if not v or re.fullmatch(r"[A-Z_][A-Z0-9_]*", v):
        return None
    return (
        "must name, in upper case, an environment variable that holds the key "
        "(e.g. VLM_API_KEY), not the key"
    )


def _score_range(v: list[float]) -> str | None:
    return None if len(v) == 2 and v[0] < v[1] else "must be [min, max] with min < max"


def _parses_number(section: Any) -> bool:
    return section.parse == "number"


def _parses_yes_no(section: Any) -> bool:
    return section.parse == "yes_no"


@dataclass
class VlmRewardSection(HttpRewardSection):
    """[reward.vlm]: the `vlm` judge, a vision-language model behind an OpenAI-compatible
    chat-completions server (vLLM, sglang), asked about each image."""

    TABLE = "reward.vlm"
    url: str = _option(
        "",
        "The server: its root (http://host:8000), its OpenAI base URL (.../v1) or the full "
        ".../v1/chat/completions path.",
        check=_remote_url,
    )
    model: str = _option(
        "", "Model name the server serves (vLLM: the model path, or --served-model-name)."
    )
    api_key_env: str = _option(
        "",
        'Environment variable holding the API key, sent as a Bearer token; "" = none.',
        check=_env_name,
        affects_results=False,
        secret=True,
    )
    template: str = _option(
        VLM_TEMPLATE,
        "The question asked with each image; {prompt} is the image's prompt, {ground_truth} "
        "its target text.",
        check=_vlm_template,
    )
    parse: Literal["number", "yes_no"] = _option(
        "number",
        "How the reply becomes a score: number (the first number, mapped from score_range to "
        "[0, 1]) or yes_no (P(yes) from the first answer token's log-probabilities).",
    )
    score_range: list[float] = _option(
        [0.0, 10.0],
        "[min, max] the judge's number must lie in; mapped linearly to [0, 1].",
        check=_score_range,
        used_when=_parses_number,
    )
    number_after: str = _option(
        "",
        'Read the number after the last occurrence of this text (e.g. "Final Score:"), '
        'case-insensitive; "" = the reply\'s first number.',
        used_when=_parses_number,
    )
    top_logprobs: int = _option(
        20,
        "Log-probabilities asked for per token (yes_no); most servers give at most 20 "
        "(vLLM: --max-logprobs).",
        check=_at_least(1),
        used_when=_parses_yes_no,
    )
    text_fallback: bool = _option(
        False,
        "yes_no without log-probabilities in the reply: score the reply's first yes / no as "
        "1 / 0 instead of stopping.",
        used_when=_parses_yes_no,
    )
    with_source_image: bool = _option(
        False,
        "Send each image's source image (an editing data set) first and the result second, "
        "in one message, for a template that compares them; prepare then refuses a text data "
        "set.",
        used_when=lambda vlm: vlm.with_source_image,
    )
    max_tokens: int = _option(512, "Most tokens the judge may reply with.", check=_at_least(1))
    temperature: float = _option(0.0, "Sampling temperature of the judge.", check=_at_least(0.0))
    concurrency: int = _option(
        8,
        "Requests in flight at once (one image each); the server batches them.",
        check=_at_least(1),
        affects_results=False,
    )


_HUB_REVISION = "Hub revision (branch, tag or commit) of `model`, resolved to a commit at load."

# The released models, as flow_grpo loads them (PickScore's processor is its base CLIP's; the
# aesthetic head is LAION's sac+logos+ava1-l14-linearMSE.pth, as TRL's DDPO publishes it).
PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIPSCORE_MODEL = "openai/clip-vit-large-patch14"
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "trl-lib/ddpo-aesthetic-predictor"
AESTHETIC_HEAD_FILE = "aesthetic-model.pth"
# HPSv2's released checkpoints (open_clip state dicts of its fine-tuned ViT-H-14) and the
# open_clip base it fine-tunes, whose config and tokenizer transformers reads.
HPSV2_CHECKPOINT = "xswu/HPSv2"
HPSV2_FILES = {"v2": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
HPSV2_BASE = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


@dataclass
class PickScoreSection(_CheckedSection):
    TABLE = "reward.pickscore"

    model: str = _option(
        PICKSCORE_MODEL, "PickScore's CLIP-H: a hub id or a local folder.", path="hub"
    )
    revision: str = _option("main", _HUB_REVISION)
    processor: str = _option(
        PICKSCORE_PROCESSOR,
        "Its image processor and tokenizer: hub id or folder (its base CLIP's, as its "
        "authors load it).",
        path="hub",
    )
    processor_revision: str = _option("main", "Hub revision of `processor`.")


@dataclass
class ClipScoreSection(_CheckedSection):
    TABLE = "reward.clipscore"

    model: str = _option(CLIPSCORE_MODEL, "The CLIP model: a hub id or a local folder.", path="hub")
    revision: str = _option("main", _HUB_REVISION)


@dataclass
class AestheticSection(_CheckedSection):
    TABLE = "reward.aesthetic"

    model: str = _option(
        AESTHETIC_CLIP, "The CLIP ViT-L/14: a hub id or a local folder.", path="hub"
    )
    revision: str = _option("main", _HUB_REVISION)
    head: str = _option(
        AESTHETIC_HEAD,
        "The aesthetic MLP: a hub id or folder holding `head_file`, or the file itself.",
        path="hub",
    )
    head_file: str = _option(AESTHETIC_HEAD_FILE, "The head's file name.")
    head_revision: str = _option("main", "Hub revision of `head`.")


@dataclass
class HpsV2Section(_CheckedSection):
    TABLE = "reward.hpsv2"

    version: Literal["v2", "v2.1"] = _option(
        "v2.1",
        "Which HPS: v2 (HPS_v2_compressed.pt) or v2.1 (HPS_v2.1_compressed.pt, trained on "
        "more data).",
    )
    checkpoint: str = _option(
        HPSV2_CHECKPOINT,
        "The released open_clip checkpoint: a hub id or folder holding the version's file, "
        "or the .pt file itself.",
        path="hub",
    )
    checkpoint_revision: str = _option("main", "Hub revision of `checkpoint`.")
    base: str = _option(
        HPSV2_BASE,
        "The CLIP ViT-H/14 HPSv2 fine-tunes: hub id or folder; only its config.json (the "
        "architecture) and tokenizer are read.",
        path="hub",
    )
    base_revision: str = _option("main", "Hub revision of `base`.")


# The CLIP-family rewards `flowgrpo plan` sizes.
MODEL_REWARDS = ("pickscore", "clipscore", "aesthetic", "hpsv2")
# GenEval's detector is mmdet's Mask2Former Swin-S on COCO; this is the transformers checkpoint
# nearest it. Its colour classifier is OpenAI's CLIP ViT-L/14.
GENEVAL_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
GENEVAL_CLIP = "openai/clip-vit-large-patch14"


@dataclass
class GenEvalSection(_CheckedSection):
    TABLE = "reward.geneval"

    detector: str = _option(
        GENEVAL_DETECTOR,
        "Mask2Former COCO instance segmentation: a hub id or a local folder.",
        path="hub",
    )
    detector_revision: str = _option("main", "Hub revision of `detector`.")
    clip: str = _option(
        GENEVAL_CLIP, "The CLIP that names each object's colour: hub id or folder.", path="hub"
    )
    clip_revision: str = _option("main", "Hub revision of `clip`.")
    score: Literal["partial", "strict", "correct"] = _option(
        "partial",
        "Which GenEval score is the reward: partial (the mean of per-clause terms, below 0 "
        "when too many objects are found; flow_grpo's training reward), strict (1 if every "
        "clause holds with exact counts, else 0) or correct (GenEval's benchmark verdict, 1 "
        "or 0).",
    )


# `source_similarity`'s image encoders: DINOv2 ViT-B/14 (DINOv2's own image-similarity
# features) and OpenAI's CLIP ViT-L/14 (CLIP-I, as `clipscore` loads it).
SOURCE_SIMILARITY_MODELS = {
    "dino": "facebook/dinov2-base",
    "clip": "openai/clip-vit-large-patch14",
}


@dataclass
class SourceSimilaritySection(_CheckedSection):
    TABLE = "reward.source_similarity"

    backbone: Literal["dino", "clip"] = _option(
        "dino",
        "The image encoder whose embeddings are compared: dino (DINOv2, its final CLS "
        "feature) or clip (CLIP's projected image embedding: CLIP-I).",
    )
    model: str = _option(
        "",
        'The encoder: a hub id or a local folder of the backbone\'s kind; "" = its released '
        "model (dino: facebook/dinov2-base, clip: openai/clip-vit-large-patch14).",
        path="hub",
    )
    revision: str = _option("main", _HUB_REVISION)


def _uses_model_reward(section: Any) -> bool:
    models = (*MODEL_REWARDS, "geneval", "source_similarity")
    return any(name in section.weights for name in models)


def _reward_table(name: str, cls: type) -> Any:
    """A reward model's table; it counts in the hash only when that reward is weighted."""
    meta = {"used_when": lambda section: name in section.weights}
    return field(default_factory=cls, metadata=meta)


@dataclass
class RewardSection(_CheckedSection):
    """[reward]: what scores the images. The reward builders read it (and its tables) as
    they are: each takes what it needs."""

    TABLE = "reward"

    weights: dict[str, float] = _option(
        {"ocr": 1.0},
        "Reward name -> weight; the total is the weighted sum. `module:function` names a plugin.",
    )
    ocr_workers: int = _option(
        1, "OCR worker processes.", check=_at_least(1), affects_results=False
    )
    on_error: Literal["drop_sample", "drop_group", "stop"] = _option(
        "drop_sample", "What a reward failure on one image does."
    )
    plugin_dirs: list[str] = _option(
        [],
        "Folders searched first for `module:function` plugins, as if on PYTHONPATH; stored "
        "absolute, so the run finds its plugins from any folder.",
        path="local",
        affects_results=False,
    )
    plugin_timeout_s: float = _option(
        600.0,
        "Seconds one call of a `module:function` plugin (one batch) may take; then its "
        "worker process is stopped and scoring stops with an error naming it.",
        check=_positive,
        affects_results=False,
    )
    device: str = _option(
        "auto",
        "Device of the model rewards (pickscore, clipscore, aesthetic, hpsv2, geneval, "
        "source_similarity): auto (this rank's GPU, else the CPU), cpu, cuda, cuda:N.",
        affects_results=False,
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = _option(
        "auto",
        "Weights of the model rewards; auto: float16 on a GPU, float32 on the CPU (geneval's "
        "detector: float32 always).",
        used_when=_uses_model_reward,
    )
    batch_size: int = _option(
        32, "Images per forward pass of a model reward.", check=_at_least(1),
        affects_results=False,
    )  # fmt: skip
    remote: RemoteRewardSection = field(default_factory=RemoteRewardSection)
    pickscore: PickScoreSection = _reward_table("pickscore", PickScoreSection)
    clipscore: ClipScoreSection = _reward_table("clipscore", ClipScoreSection)
    aesthetic: AestheticSection = _reward_table("aesthetic", AestheticSection)
    vlm: VlmRewardSection = _reward_table("vlm", VlmRewardSection)
    hpsv2: HpsV2Section = _reward_table("hpsv2", HpsV2Section)
    geneval: GenEvalSection = _reward_table("geneval", GenEvalSection)
    source_similarity: SourceSimilaritySection = _reward_table(
        "source_similarity", SourceSimilaritySection
    )


def _anchor_decay(v: list[float]) -> str | None:
    if not v:
        return None
    if len(v) != 3 or v[0] < 0 or v[1] < 0 or not 0 <= v[2] < 1:
        return "must be [] or [start, slope, max] with start, slope >= 0 and 0 <= max < 1"
    return None


@dataclass
class AlgorithmSection:
    name: Literal["flow_grpo", "grpo_guard", "mixgrpo", "nft", "awm"] = _option(
        "flow_grpo",
        "flow_grpo (SDE log-probs, clipped ratio), grpo_guard (its ratio normalised per "
        "step), mixgrpo (its SDE window sliding with training), nft (DiffusionNFT) or awm "
        "(Advantage Weighted Matching); the last two train on the clean latent alone, CFG-free.",
    )
    group_size: int = _option(24, "Images per prompt (the GRPO group).", check=_at_least(2))
    prompts_per_iteration: int = _option(48, "Prompts (groups) per iteration.", check=_at_least(1))
    advantage_std: Literal["global", "group", "none"] = _option(
        "global", "Std that divides advantages: over the iteration, per group, or none (Dr. GRPO)."
    )
    # Came after runs existed: out of the hash at its default, as the window keys.
    advantage_std_ddof: int = _option(
        0,
        "Delta degrees of freedom of the advantage std (global or group): 0 divides the "
        "summed squares by n (the population std), 1 by n - 1 (Bessel's correction, as "
        "MixGRPO's torch .std() in train_grpo_flux.py).",
        check=lambda v: None if v in (0, 1) else "must be 0 or 1",
        used_when=lambda algorithm: algorithm.advantage_std_ddof != 0,
    )
    advantage_clip: float = _option(5.0, "Advantages are clipped to +-this.", check=_positive)
    # Came after runs existed: out of the hash at its default, as the window keys.
    reward_aggregation: Literal["weighted_sum", "normalize_each"] = _option(
        "weighted_sum",
        "How several rewards make one advantage: weighted_sum takes the group-relative "
        "advantage of the weighted total; normalize_each (GDPO) takes each reward's own "
        "(advantage_std, advantage_std_ddof and eps as for the total; not with "
        'advantage_std = "none"), sums them with the weights, then divides the sum by its std '
        "over the iteration.",
        used_when=lambda algorithm: algorithm.reward_aggregation != "weighted_sum",
    )
    clip_range: float = _option(1e-4, "PPO clip range eps of the policy ratio.", check=_positive)
    beta: float = _option(
        0.04,
        "Weight of the KL to the reference (LoRA disabled): the step KL for flow_grpo, "
        "mean((v - v_ref)^2) for nft / awm (their OCR recipes: 1e-4, 0.003).",
        check=_at_least(0.0),
    )
    kl_convention: Literal["reference", "gaussian"] = _option(
        "reference",
        "What the KL divides by: the Flow-GRPO code's std_dev_t (published betas assume it) "
        "or the step's own std (the exact per-step Gaussian KL, 1/(-dt) times larger for sde).",
    )
    drop_zero_advantage: bool = _option(
        True, "Leave samples with advantage 0 out of the optimizer batches (as the reference)."
    )
    recompute_old_logprobs: bool = _option(
        False, "Recompute old log-probs at the start of update instead of the rollout's."
    )
    train_timesteps: int = _option(
        0,
        "nft / awm: noise levels trained per sample, drawn from the rollout's sigmas; 0 = the "
        "algorithm's own (nft: int(0.99 T) of T; awm: 6, stratified).",
        check=_at_least(0),
    )
    nft_beta: float = _option(
        1.0,
        "nft: beta of the implicit policies v+ = (1 - b) v_old + b v, v- = (1 + b) v_old - b v "
        "(the authors' OCR recipe: 0.1).",
        check=_positive,
    )
    anchor_decay: list[float] = _option(
        [],
        "nft / awm: [start, slope, max]; after each update the anchor (nft: the sampling "
        "policy; awm: the KL's EMA) moves to the weights with decay 0 before `start` "
        "optimizer steps, then min(slope (n - start), max). [] = nft [0, 0.001, 0.5], "
        "awm [0, 0.001, 0.3].",
        check=_anchor_decay,
    )
    anchor_kl: float = _option(
        1.0, "awm: weight of the velocity KL to the anchor.", check=_at_least(0.0)
    )
    awm_power: float = _option(
        0.25,
        "awm: p of the generalised-Huber weighting of the flow-matching loss.",
        check=_in_unit_interval,
    )
    # Came after runs existed: out of the hash at its default, as the window keys above.
    awm_negative_weight: float = _option(
        1.0,
        "awm: scale of the negative advantages' weights: 1 pushes the flow-matching error of "
        "below-average samples up as hard as it pulls the others' down (the paper); 0 learns "
        "from the above-average samples alone.",
        check=lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]",
        used_when=lambda algorithm: algorithm.awm_negative_weight != 1.0,
    )
    train_cfg: bool = _option(
        False,
        "nft / awm: train the guided velocity v_neg + g (v - v_neg) the images were sampled "
        "with (g = sampler.guidance_scale; two forwards per noise level) instead of the "
        "conditional velocity alone (CFG-free, both papers').",
        used_when=lambda algorithm: algorithm.train_cfg,
    )


@dataclass
class TrainSection:
    mode: Literal["lora", "full"] = _option("lora", "Train LoRA adapters or the full transformer.")
    lr: float = _option(3e-4, "AdamW learning rate.", check=_positive)
    weight_decay: float = _option(1e-4, "AdamW weight decay.", check=_at_least(0.0))
    warmup_steps: int = _option(
        0, "Linear learning-rate warm-up, in optimizer steps.", check=_at_least(0)
    )
    max_grad_norm: float = _option(1.0, "Gradient-norm clip.", check=_positive)
    micro_batch_size: int = _option(4, "Samples per forward in update.", check=_at_least(1))
    inner_epochs: int = _option(1, "Passes over an iteration's samples.", check=_at_least(1))
    steps_per_epoch: int = _option(
        2,
        "Optimizer steps per pass; the shuffled samples are split evenly among them.",
        check=_at_least(1),
    )
    lora_rank: int = _option(32, "LoRA rank r.", check=_at_least(1))
    lora_alpha: int = _option(64, "LoRA alpha.", check=_at_least(1))
    lora_targets: list[str] = _option(
        [], "Module names to adapt (peft suffixes); [] = the family's reference recipe."
    )
    ema_decay: float = _option(
        0.0,
        "EMA of trained weights (evaluated, saved to ema/); its decay warms up as min(decay, "
        "(1 + n) / (10 + n)) after n optimizer steps, as the reference's. 0 = off.",
        check=_decay,
    )
    ema_interval: int = _option(1, "Optimizer steps between EMA updates.", check=_at_least(1))
    gradient_checkpointing: bool = _option(
        False, "Recompute activations in backward.", affects_results=False
    )
    mixed_precision: Literal["none", "bfloat16"] = _option(
        "none",
        "bfloat16: the transformer's forwards (rollout, update, evaluation) run under "
        "bfloat16 autocast, and FSDP2 gathers its parameters in bfloat16; weights, gradients "
        "and optimizer state keep model.dtype. Useful with model.dtype = float32.",
    )


@dataclass
class EvalSection:
    every: int = _option(
        5, "Evaluate every k iterations (and before the first); 0 = never.", check=_at_least(0)
    )
    num_steps: int = _option(40, "ODE steps for evaluation images.", check=_at_least(2))
    guidance_scale: float = _option(4.5, "CFG scale for evaluation.", check=_at_least(1.0))
    num_prompts: int = _option(0, "Test prompts evaluated; 0 = all.", check=_at_least(0))
    # Came after runs existed; they change no stage's output (only what the loop reports and
    # where it stops), so they stay out of the hash, and of the evaluations' identity.
    drift_window: int = _option(
        3,
        "Warn when, over the last k evaluations, the training reward rose while the held-out "
        "eval/reward_mean fell (least-squares slopes against the iteration; the training "
        "reward of an evaluation is the mean reward/mean of the iterations since the previous "
        "one): one line in the loop's output, eval/drift = 1 in metrics.jsonl. 0 = off.",
        check=lambda v: None if v == 0 or v >= 2 else "must be 0 (off) or at least 2",
        affects_results=False,
    )
    stop_on_drift: bool = _option(
        False,
        "Stop the loop (exit 0) at an evaluation eval.drift_window finds drifting, naming the "
        "best held-out evaluation's checkpoint (`flowgrpo export --best`).",
        affects_results=False,
    )
    # Came after runs existed: out of the hash at its default, as the sampler's window keys.
    ode_solver: Literal["euler", "dpm++2m"] = _option(
        "euler",
        "Solver of the evaluation's ODE steps: euler (both DiffusionNFT's and AWM's evaluation) "
        "or dpm++2m; apart from sampler.ode_solver, so evaluations stay comparable.",
        used_when=lambda section: section.ode_solver != "euler",
    )


@dataclass
class DistributedSection:
    backend: Literal["torch", "ray"] = _option(
        "torch",
        "torch = torch.distributed's launcher on this host; ray = a Ray cluster.",
        affects_results=False,
    )
    nproc: int = _option(
        1, "Ranks (processes, one per device).", check=_at_least(1), affects_results=False
    )
    ray_address: str = _option(
        "", "Ray cluster address (`auto` = the local one).", affects_results=False
    )
    gpus_per_worker: float = _option(
        0.0, "GPUs per Ray worker.", check=_at_least(0.0), affects_results=False
    )
    cpus_per_worker: float = _option(
        1.0, "CPUs per Ray worker.", check=_positive, affects_results=False
    )
    score_tasks: int = _option(
        0,
        "Ray: score rollout parts as up to this many Ray tasks apart from the ranks "
        "(0 = the ranks score).",
        check=_at_least(0),
        affects_results=False,
    )
    score_cpus: float = _option(
        1.0, "CPUs per Ray score task.", check=_at_least(0.0), affects_results=False
    )
    score_gpus: float = _option(
        0.0, "GPUs per Ray score task.", check=_at_least(0.0), affects_results=False
    )
    score_resource: str = _option(
        "",
        "Custom Ray resource a score task takes one unit of (`ray start --resources`), to "
        'keep scoring on chosen nodes; "" = none.',
        affects_results=False,
    )


def _trackers(names: list[str]) -> str | None:
    known = ("tensorboard", "wandb", "trackio")
    unknown = [name for name in names if name not in known]
    return f"names unknown trackers {unknown}; choose from {list(known)}" if unknown else None


@dataclass
class LogSection:
    trackers: list[str] = _option(
        ["tensorboard"],
        "Experiment trackers fed each iteration's metrics and grids and the config: "
        "tensorboard (skipped when not installed), wandb, trackio (each an extra).",
        check=_trackers,
        affects_results=False,
    )
    project: str = _option("flowgrpo", "Project name in W&B and trackio.", affects_results=False)
    name: str = _option(
        "", "Run name in the trackers; empty = the run folder's name.", affects_results=False
    )


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    log: LogSection = field(default_factory=LogSection)


# ---------------------------------------------------------------------------------------------
# Loading and validation


@dataclass(frozen=True)
class _Source:
    """Where raw values came from, to point error messages at a file line or an override."""

    file: Path | None
    text: str
    overrides: dict[str, str]  # dotted key -> the --set argument that set it

    def base_of(self, dotted: str) -> Path | None:
        """The folder a relative path in `dotted` is relative to: the config file's, or None
        (the working directory) for a `--set` override."""
        if dotted in self.overrides or self.file is None:
            return None
        return self.file.parent

    def where(self, dotted: str) -> str:
        """The --set argument, or the file and line, that gave `dotted` (a key or a table)."""
        if dotted in self.overrides:
            return f"--set {self.overrides[dotted]}"
        line = _line_of(self.text, dotted) if self.file is not None else None
        if line:
            return f"{self.file}:{line}"
        below = [item for key, item in self.overrides.items() if key.startswith(dotted + ".")]
        if below:  # a table only an override made: `--set samplr.kind=sde`
            return f"--set {below[0]}"
        return str(self.file) if self.file is not None else "defaults"


def _line_of(text: str, dotted: str) -> int | None:
    """Line of `key = ...` inside its table, found by a scan (tomllib keeps no positions)."""
    *table, key = dotted.split(".")
    want = ".".join(table)
    current = ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([^\[\]]+?)\s*\]\s*(#.*)?", stripped)
        if header:
            current = header.group(1).replace(" ", "").replace('"', "")
            if current == dotted:  # a table such as [reward.remote] itself
                return number
            continue
        match = re.match(r'\s*"?([^"=\s]+)"?\s*=', line)
        if match:
            full = f"{current}.{match.group(1)}" if current else match.group(1)
            if full == dotted or (current == want and match.group(1) == key):
                return number
    return None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a table of {_type_name(typing.get_args(tp)[1])} values"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check `value` against the annotation `tp`; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp), value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            return False, value
        items = [_coerce(v, item_tp) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        _, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            return False, value
        entries = {k: _coerce(v, value_tp) for k, v in value.items()}
        return all(ok for ok, _ in entries.values()), {k: v for k, (_, v) in entries.items()}
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok and math.isfinite(value), float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    raise TypeError(f"unsupported config field type {tp}")


def _looks_like_hub_id(value: str) -> bool:
    """`owner/name` or `name`: what the Hub accepts as a repository id; anything with more
    slashes, a leading `.`, `/` or `~` is a path."""
    return re.fullmatch(r"[\w\-.]+(/[\w\-.]+)?", value) is not None and not value.startswith(".")


def _expand_path(value: str, kind: str, base: Path | None = None) -> str:
    """`~` and `$VARS` expanded, and made absolute, so the run's stored config means the same
    from any folder. A relative input path is relative to `base`, the folder of the config file
    that wrote it (None: the working directory, for `--set` and defaults); an `output` path
    (run.dir) always to the working directory. A `hub` value that names no local folder and
    looks like a repository id stays as written (diffusers looks for a local folder of that
    name first too).
    """
    if not value:
        return value
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    if kind != "output" and base is not None and not path.is_absolute():
        path = base / path
    if kind == "hub" and not path.exists() and _looks_like_hub_id(value):
        return value
    return os.path.abspath(path)  # `..` folded away, symbolic links kept


def _expand_paths(value: Any, kind: str, base: Path | None = None) -> Any:
    if isinstance(value, list):
        return [_expand_path(item, kind, base) for item in value]
    return _expand_path(value, kind, base)


# Names users bring from other trainers (diffusers, TRL, the paper's code) -> our key. A key
# whose last part the section has (`eval.cfg` -> `eval.guidance_scale`) stays in its section.
KEY_ALIASES = {
    "learning_rate": "train.lr",
    "learningrate": "train.lr",
    "num_inference_steps": "sampler.num_steps",
    "inference_steps": "sampler.num_steps",
    "sample_steps": "sampler.num_steps",
    "cfg": "sampler.guidance_scale",
    "cfg_scale": "sampler.guidance_scale",
    "guidance": "sampler.guidance_scale",
    "batch_size": "train.micro_batch_size",
    "train_batch_size": "train.micro_batch_size",
    "per_device_train_batch_size": "train.micro_batch_size",
    "sample_batch_size": "sampler.batch_size",
    "num_generations": "algorithm.group_size",
    "num_images_per_prompt": "algorithm.group_size",
    "kl_coef": "algorithm.beta",
    "kl_beta": "algorithm.beta",
    "clip_epsilon": "algorithm.clip_range",
    "eta": "sampler.noise_level",
    "lora_r": "train.lora_rank",
    "rank": "train.lora_rank",
    "pretrained_model_name_or_path": "model.path",
    "model_name_or_path": "model.path",
}


def _suggest_key(prefix: str, key: str) -> str | None:
    """The key a user meant by the unknown `prefix.key`: an alias, a close name in the same
    section, or the same name in another section (`train.group_size`)."""
    section = _section_class(prefix)
    fields = [f.name for f in dataclasses.fields(section)] if section else []
    alias = KEY_ALIASES.get(key.lower())
    if alias is not None:
        last = alias.rsplit(".", 1)[1]
        return f"{prefix}.{last}" if last in fields else alias
    close = difflib.get_close_matches(key, fields, n=1)
    if close:
        return f"{prefix}.{close[0]}"
    elsewhere = [dotted for dotted, _, _ in iter_reference() if dotted.endswith(f".{key}")]
    return elsewhere[0] if elsewhere else None


def _section_class(prefix: str) -> type | None:
    cls: Any = Config
    for part in prefix.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return None
        cls = hints[part]
    return cls


def _build_section(
    cls: type, raw: dict[str, Any], prefix: str, source: _Source, errors: list[str]
) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}"
        if key not in fields:
            close = _suggest_key(prefix, key)
            hint = f"; did you mean `{close}`?" if close else ""
            valid = ", ".join(fields)
            errors.append(
                f"{source.where(dotted)}: unknown key `{dotted}`{hint} "
                f"(valid keys of [{prefix}]: {valid})"
            )
            continue
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                errors.append(f"{source.where(dotted)}: `{dotted}` must be a table")
                continue
            values[key] = _build_section(tp, value, dotted, source, errors)
            continue
        ok, coerced = _coerce(value, tp)
        if not ok:
            errors.append(f"{source.where(dotted)}: `{dotted}` = {value!r} is not {_type_name(tp)}")
            continue
        meta = fields[key].metadata
        problem = meta["check"](coerced) if meta.get("check") else None
        if problem:
            shown = "(value not shown)" if meta.get("secret") else repr(value)
            errors.append(f"{source.where(dotted)}: `{dotted}` = {shown} {problem}")
            continue
        path_kind = meta.get("path")
        values[key] = (
            _expand_paths(coerced, path_kind, source.base_of(dotted)) if path_kind else coerced
        )
    for name, f in fields.items():  # a default path (run.dir) is as relative as a given one
        if f.metadata.get("path") and name not in values:
            values[name] = _expand_paths(getattr(cls(), name), f.metadata["path"])
    return cls(**values)


def _parse_override(item: str) -> tuple[str, Any]:
    """`sampler.noise_level=0.8` -> ("sampler.noise_level", 0.8); bare words stay strings."""
    if "\n" in item or "\r" in item:  # TOML would end the value there and drop the rest
        raise FlowGrpoError(
            f"--set {item!r}: a value cannot hold a newline; give one KEY=VALUE per --set "
            "(a TOML string writes one as \\n)"
        )
    if "=" not in item:
        raise FlowGrpoError(f"--set {item}: expected KEY=VALUE, e.g. sampler.noise_level=0.8")
    key, text = item.split("=", 1)
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[\w\-:\"]+)+", key):
        raise FlowGrpoError(
            f"--set {item}: `{key}` is not a dotted key such as sampler.noise_level"
        )
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare path or name: `--set model.path=runs/tiny-model`
    return key, value


def _apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    *tables, last = [part.strip('"') for part in key.split(".")]
    node = raw
    for table in tables:
        node = node.setdefault(table, {})
        if not isinstance(node, dict):
            raise FlowGrpoError(f"--set {key}: `{table}` is not a table")
    node[last] = value


def build_config(raw: dict[str, Any], source: _Source) -> Config:
    errors: list[str] = []
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    values = {}
    for name, table in raw.items():
        if name not in sections:
            close = difflib.get_close_matches(name, list(sections), n=1)
            hint = f"; did you mean [{close[0]}]?" if close else ""
            errors.append(
                f"{source.where(name)}: unknown section [{name}]{hint} "
                f"(valid sections: {', '.join(sections)})"
            )
        elif not isinstance(table, dict):
            errors.append(f"{source.where(name)}: `{name}` must be a table ([{name}])")
        else:
            values[name] = _build_section(hints[name], table, name, source, errors)
    for name in sections.keys() - raw.keys():  # defaults, with their paths made absolute
        values[name] = _build_section(hints[name], {}, name, source, errors)
    if errors:
        raise FlowGrpoError("invalid config:\n  " + "\n  ".join(errors))
    return Config(**values)


def load_config(path: Path | str | None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML config (or the defaults when path is None) and apply `--set` overrides."""
    raw: dict[str, Any] = {}
    text = ""
    file = None
    if path is not None:
        file = Path(_expand_path(str(path), "local"))
        if not file.is_file():
            raise FlowGrpoError(f"config file {file} does not exist")
        data = file.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            column = err.start - data.rfind(b"\n", 0, err.start)
            raise FlowGrpoError(
                f"{file}:{line}:{column}: not UTF-8 (byte 0x{data[err.start]:02x}); TOML files "
                "are UTF-8"
            ) from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise FlowGrpoError(f"{file}: not valid TOML: {err}") from None
    applied: dict[str, str] = {}
    for item in overrides:
        key, value = _parse_override(item)
        _apply_override(raw, key, value)
        applied[key.replace('"', "")] = item
    return build_config(raw, _Source(file, text, applied))


# ---------------------------------------------------------------------------------------------
# Writing, hashing and comparing


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _results_view(section: Any) -> dict[str, Any]:
    """The fields that change what a run computes (see the module docstring)."""
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        used_when = f.metadata.get("used_when")
        if used_when is not None and not used_when(section):
            continue
        if dataclasses.is_dataclass(value):
            out[f.name] = _results_view(value)
        elif f.metadata.get("affects_results", True):
            out[f.name] = value
    return out


# The config sections each stage's output depends on (its manifest records their hash).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "prepare": ("run", "data"),
    "rollout": ("run", "data", "model", "sampler", "algorithm"),
    "scores": ("reward",),
    "update": ("run", "data", "model", "sampler", "reward", "algorithm", "train"),
}


def config_hash(config: Config, sections: tuple[str, ...] | None = None) -> str:
    """Hash of the results-affecting values, of the whole config or of some sections."""
    view = _results_view(config)
    if sections is not None:
        view = {name: view[name] for name in sections}
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_diff(old: Config, new: Config) -> list[str]:
    """Lines `key: old -> new` for every results-affecting value that differs."""
    a, b = _flatten(_results_view(old)), _flatten(_results_view(new))
    return [
        f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        for key in sorted(a.keys() | b.keys())
        if a.get(key) != b.get(key)
    ]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_\-]+", key) else json.dumps(key)


def dumps_config(config: Config) -> str:
    """The resolved config as TOML, every key written, each with its help as a comment."""
    lines: list[str] = []

    def section(obj: Any, name: str) -> None:
        lines.append(f"[{name}]")
        tables = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) or isinstance(value, dict):
                tables.append((f.name, value))
                continue
            lines.append(f"{f.name} = {_toml_value(value)}  # {f.metadata['help']}")
        lines.append("")
        for key, value in tables:
            if isinstance(value, dict):
                lines.append(f"[{name}.{key}]")
                lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
                lines.append("")
            else:
                section(value, f"{name}.{key}")

    for f in dataclasses.fields(config):
        section(getattr(config, f.name), f.name)
    return "\n".join(lines)


def iter_reference(cls: type = Config, prefix: str = "") -> typing.Iterator[tuple[str, str, str]]:
    """(dotted key, default, help) for every key: the docs' configuration reference."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from iter_reference(tp, dotted + ".")
        else:
            meaning = f.metadata["help"]
            if typing.get_origin(tp) is Literal:
                meaning = f"{meaning.rstrip('.')}; {_type_name(tp)}."
            yield dotted, _toml_value_or_table(getattr(defaults, f.name)), meaning


def _toml_value_or_table(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return _toml_value(value)
