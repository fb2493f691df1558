"""Settings rewards read when they are built (kept apart so that naming them loads nothing)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field

from flowgrpo_cli.errors import FlowGrpoError


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


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach the scoring server; the fields mirror the config's [reward.remote]."""

    url: str
    timeout_s: float = 60.0  # per attempt: connect, send, and the whole reply
    max_retries: int = 3  # attempts after the first one
    batch_size: int = 16  # images per request
    backoff_s: float = 1.0  # wait before the first retry; doubles for each further one
    max_reply_mb: float = 16.0  # a larger reply is refused, not read
    deadline_s: float = 600.0  # per batch of the score stage: every request and retry in it

    def __post_init__(self) -> None:
        problem = url_problem(self.url)
        if problem is not None:
            raise FlowGrpoError(f"reward.remote.url = {self.url!r}: {problem}")
        if not self.deadline_s > 0:
            raise FlowGrpoError(f"[reward.remote] deadline_s = {self.deadline_s}: must be > 0")
        if not self.timeout_s > 0:
            raise FlowGrpoError(f"[reward.remote] timeout_s = {self.timeout_s}: must be > 0")
        if not self.backoff_s >= 0:
            raise FlowGrpoError(f"[reward.remote] backoff_s = {self.backoff_s}: must be >= 0")
        if self.max_retries < 0:
            raise FlowGrpoError(f"[reward.remote] max_retries = {self.max_retries}: must be >= 0")
        if self.batch_size < 1:
            raise FlowGrpoError(f"[reward.remote] batch_size = {self.batch_size}: must be >= 1")
        if not self.max_reply_mb > 0:
            raise FlowGrpoError(f"[reward.remote] max_reply_mb = {self.max_reply_mb}: must be > 0")


# The released models, as flow_grpo loads them (PickScore's processor is its base CLIP's; the
# aesthetic head is LAION's sac+logos+ava1-l14-linearMSE.pth, as TRL's DDPO publishes it).
PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIPSCORE_MODEL = "openai/clip-vit-large-patch14"
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "trl-lib/ddpo-aesthetic-predictor"
AESTHETIC_HEAD_FILE = "aesthetic-model.pth"


@dataclass(frozen=True)
class ModelSource:
    """Where a reward model comes from: a local folder, or a hub id at a revision."""

    model: str
    revision: str = "main"  # branch, tag or commit; ignored for a local folder


@dataclass(frozen=True)
class ModelRewardOptions:
    """Settings of the rewards that run a neural network (pickscore, clipscore, aesthetic);
    the fields mirror the config's [reward] device / dtype / batch_size and its
    [reward.pickscore], [reward.clipscore] and [reward.aesthetic] tables."""

    device: str = "auto"  # auto: this rank's GPU when there is one, else the CPU
    dtype: str = "auto"  # auto: float16 on a GPU, float32 on the CPU
    batch_size: int = 32  # images per forward pass
    pickscore: ModelSource = ModelSource(PICKSCORE_MODEL)
    pickscore_processor: ModelSource = ModelSource(PICKSCORE_PROCESSOR)
    clipscore: ModelSource = ModelSource(CLIPSCORE_MODEL)
    aesthetic: ModelSource = ModelSource(AESTHETIC_CLIP)
    aesthetic_head: ModelSource = ModelSource(AESTHETIC_HEAD)
    aesthetic_head_file: str = AESTHETIC_HEAD_FILE

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise FlowGrpoError(
                f"[reward] dtype = {self.dtype!r}: choose auto, float32, float16 or bfloat16"
            )
        if self.batch_size < 1:
            raise FlowGrpoError(f"[reward] batch_size = {self.batch_size}: must be >= 1")


@dataclass(frozen=True)
class RewardOptions:
    """What build_rewards passes to every reward's builder; each reads what it needs."""

    ocr_workers: int = 1
    remote: RemoteOptions | None = None
    plugin_timeout_s: float = 600.0  # per call of a `module:function` plugin
    models: ModelRewardOptions = field(default_factory=ModelRewardOptions)
