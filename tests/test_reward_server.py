"""`flowgrpo serve-reward` end to end: the `remote` reward talking to a served reward."""

import asyncio
import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
from pathlib import Path

import pytest
from helpers import serving_reward
from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.rewards.rewardset import ScoreResult
from flowgrpo_cli.store.config import ClipScoreSection, RemoteRewardSection, RewardSection

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "plugins"
# A plugin that misbehaves on request: the prompt "broken" returns no scores (a bug: the
# whole batch fails), "slow" takes 3 s; any other prompt gets the image's brightness.
MOODY = """
import time
from brightness import score as brightness

def score(images, prompts, metadata):
    if prompts[0] == "slow":
        time.sleep(3)
    if prompts[0] == "broken":
        return []
    return brightness(images, prompts, metadata)
"""


def batch(prompt: str = "a sign") -> RewardBatch:
    images = [Image.new("RGB", (48, 48), (level, 90, 200)) for level in (0, 80, 160, 240)]
    metadata = [{"sample_id": f"s{i}", "group_id": 0} for i in range(len(images))]
    return RewardBatch(images, [prompt] * len(images), ["OPEN"] * len(images), metadata)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server with jpeg_compressibility + 0.5 x the moody plugin + 0.1 x OCR (in a worker
    process, so that stopping cleanly means something); its URL and process."""
    plugins = tmp_path_factory.mktemp("plugins")
    (plugins / "rw_moody.py").write_text(textwrap.dedent(MOODY))
    process = subprocess.Popen(
        [sys.executable, "-m", "flowgrpo_cli", "serve-reward", "--port", "0",
         "--reward", "jpeg_compressibility", "--reward", "rw_moody:score=0.5",
         "--reward", "ocr=0.1", "--ocr-workers", "2",
         "--plugin-dir", str(plugins), "--plugin-dir", str(EXAMPLES)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = process.stdout.readline()
    assert "serving" in line, line + process.stderr.read()
    url = line.split(" at ")[-1].strip()
    _get(url, "/health")  # answering: its signal handlers are in place
    yield url, process, plugins
    if process.poll() is None:
        process.kill()


def _get(url: str, path: str) -> dict:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    connection.request("GET", path)
    return json.loads(connection.getresponse().read())


def remote(url: str, **options):
    settings = RewardSection(remote=RemoteRewardSection(url=url, **options))
    return build_rewards({"remote": 1.0}, settings)


def test_served_scores_equal_the_in_process_rewards(server, monkeypatch):
    url, _, plugins = server
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.syspath_prepend(str(plugins))
    served = {"jpeg_compressibility": 1.0, "rw_moody:score": 0.5, "ocr": 0.1}
    with build_rewards(served) as local:
        expected = local.score(batch()).reward
    assert all(value is not None for value in expected)
    with remote(url, batch_size=3) as rewards:  # two requests: 3 images, then 1
        assert rewards.score(batch()).reward == expected
    assert _get(url, "/health") == {"status": "ok", "rewards": served}


def test_server_errors_reach_the_remote_reward_as_documented(server):
    url, _, _ = server
    with remote(url, max_retries=1, backoff_s=0) as rewards, pytest.raises(FlowGrpoError) as err:
        rewards.score(batch("broken"))  # a bug in a served reward: HTTP 500, retried, reported
    assert "no reply after 2 attempt" in str(err.value) and "HTTP 500" in str(err.value)
    assert "rw_moody:score" in str(err.value)
    with remote(url, max_retries=0, timeout_s=0.5) as rewards, pytest.raises(FlowGrpoError) as err:
        rewards.score(batch("slow"))
    # The socket's own timeout or the attempt's deadline, whichever fires first on a busy
    # machine: either way the message names the setting that bounds the wait.
    assert "no reply after 1 attempt" in str(err.value) and "timeout_s = 0.5" in str(err.value)
    # A malformed request: HTTP 400 saying what is wrong.
    parts = urllib.parse.urlsplit(url)
    for body, problem in [
        (b"not json", "the body is not JSON"),
        (b'{"images": ["abc"]}', "images[0] is not a base64-encoded image"),
        (b'{"images": []}', "`images` must be a non-empty list"),
    ]:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        connection.request("POST", "/score", body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        assert reply.status == 400 and problem in json.loads(reply.read())["error"]


def test_concurrent_remote_clients_each_get_their_own_scores(server):
    """Three `remote` rewards at once against the served rewards, whose requests the server
    may merge: each gets what it gets alone (merging changes which images share a batch, not
    their scores; the merging itself is checked above)."""
    url, _, _ = server
    with remote(url, batch_size=4) as rewards:
        alone = rewards.score(batch()).reward
    with concurrent.futures.ThreadPoolExecutor(3) as pool:

        def one(_):
            with remote(url, batch_size=4) as rewards:
                return rewards.score(batch()).reward

        assert list(pool.map(one, range(3))) == [alone] * 3


def test_the_server_stops_cleanly(server):
    _, process, _ = server
    workers = _children(process.pid)
    assert len(workers) >= 2  # the OCR pool's workers, started by the first batch
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0, process.stderr.read()
    # None left running. multiprocessing's resource tracker ends just after the server, as
    # in any Python program, and stays a zombie where the container's init reaps no one.
    deadline = time.monotonic() + 10  # the tracker notices its parent is gone within moments
    while (left := _running(workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == {}


def _running(pids: list[str]) -> dict[str, str]:
    commands = {pid: _command(pid) for pid in pids}
    return {pid: c for pid, c in commands.items() if c != "gone" and not c.startswith("Z")}


def _command(pid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return stat + " " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"


def _children(parent: int) -> list[str]:
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and _parent(pid) == parent]


def test_without_the_extra_the_error_names_it(monkeypatch):
    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    result = CliRunner().invoke(app, ["serve-reward", "--reward", "jpeg_compressibility"])
    assert result.exit_code == 1 and "pip install 'flowgrpo[serve]'" in result.output


def _parent(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_a_model_reward_is_served_with_the_settings_of_a_config(tmp_path):
    """`serve-reward -c`: the config's [reward.clipscore] model, served; equal scores."""
    from flowgrpo_cli.models.tiny import build_tiny_clip

    clip = build_tiny_clip(tmp_path / "clip")
    config = tmp_path / "rewards.toml"
    config.write_text(
        f'[reward]\ndevice = "cpu"\nweights = {{ clipscore = 1.0 }}\n'
        f'[reward.clipscore]\nmodel = "{clip}"\n'
    )
    with serving_reward("-c", str(config), announces="serving clipscore") as url:
        settings = RewardSection(device="cpu", clipscore=ClipScoreSection(model=str(clip)))
        with build_rewards({"clipscore": 1.0}, settings) as local:
            expected = local.score(batch()).reward
        with remote(url) as rewards:
            assert rewards.score(batch()).reward == pytest.approx(expected, abs=1e-6)


class _CountingRewards:
    """Stands in for a RewardSet: the mean of each image's red channel, slowly; records the
    size of every batch it scores and fails a batch holding the prompt "broken"."""

    def __init__(self):
        self.weights, self.sizes = {"red": 1.0}, []

    def score(self, batch):
        self.sizes.append(len(batch))
        time.sleep(0.2)
        if "broken" in batch.prompts:
            raise FlowGrpoError("red: the reward broke")
        values = [image.getpixel((0, 0))[0] / 255 for image in batch.images]
        none = [None] * len(values)
        seen = {"red": {"seen": list(batch.prompts)}}
        return ScoreResult(("red",), {"red": values}, {"red": none}, values, none, seen)


def test_waiting_requests_are_scored_together_and_each_gets_its_own_scores():
    from flowgrpo_cli.rewards.server import BatchingScorer

    async def scenario(rewards, max_images, prompts):
        scorer = BatchingScorer(rewards, max_images)
        first = asyncio.create_task(scorer.score(batch(prompts[0])))
        await asyncio.sleep(0.05)  # the first batch is being scored: the others wait
        rest = [asyncio.create_task(scorer.score(batch(p))) for p in prompts[1:]]
        return await asyncio.gather(first, *rest, return_exceptions=True)

    expected = [0.0, 80 / 255, 160 / 255, 240 / 255]  # batch()'s four red levels
    rewards = _CountingRewards()
    results = asyncio.run(scenario(rewards, 64, ["a", "b", "c", "d"]))
    assert rewards.sizes == [4, 12]  # the lone first request at once, then the three waiting
    for prompt, result in zip("abcd", results, strict=True):
        assert result.reward == pytest.approx(expected)
        assert result.details["red"]["seen"] == [prompt] * 4  # its own images, in order
    rewards = _CountingRewards()
    asyncio.run(scenario(rewards, 8, ["a", "b", "c", "d"]))
    assert rewards.sizes == [4, 8, 4]  # at most --max-batch images a batch
    # One request's failure stays its own: the merged batch fails, each is scored alone.
    rewards = _CountingRewards()
    results = asyncio.run(scenario(rewards, 64, ["a", "b", "broken", "d"]))
    assert rewards.sizes == [4, 12, 4, 4, 4]
    assert isinstance(results[2], FlowGrpoError) and "the reward broke" in str(results[2])
    assert [r.reward for r in results[:2] + results[3:]] == [pytest.approx(expected)] * 3


def test_requests_merge_only_with_those_that_carry_source_images_as_they_do():
    """Waiting requests with and without source images are scored in separate batches; each
    request gets the scores of its own images' sources back."""
    from flowgrpo_cli.rewards.server import BatchingScorer

    class SourceRed(_CountingRewards):
        def score(self, batch):
            if batch.source_images is None:
                return super().score(batch)
            self.sizes.append(len(batch))
            time.sleep(0.2)
            values = [image.getpixel((0, 0))[0] / 255 for image in batch.source_images]
            none = [None] * len(values)
            return ScoreResult(("red",), {"red": values}, {"red": none}, values, none, {})

    def edits(level: int) -> RewardBatch:
        plain = batch()
        sources = [Image.new("RGB", (8, 8), (level, 0, 0))] * len(plain)
        return RewardBatch(plain.images, plain.prompts, None, plain.metadata, sources)

    async def scenario(rewards):
        scorer = BatchingScorer(rewards, 64)
        first = asyncio.create_task(scorer.score(edits(10)))
        await asyncio.sleep(0.05)
        rest = [scorer.score(b) for b in (batch(), edits(20), batch(), edits(30))]
        return await asyncio.gather(first, *[asyncio.create_task(r) for r in rest])

    rewards = SourceRed()
    results = asyncio.run(scenario(rewards))
    assert rewards.sizes == [4, 8, 8]  # the first; the two text requests; the two edits
    plain = [0.0, 80 / 255, 160 / 255, 240 / 255]
    expected = [[10 / 255] * 4, plain, [20 / 255] * 4, plain, [30 / 255] * 4]
    assert [result.reward for result in results] == [pytest.approx(e) for e in expected]


SIMILARITY = """
import numpy as np

def score(images, prompts, metadata, source_images):
    out = []
    for image, source in zip(images, source_images, strict=True):
        a = np.asarray(image.convert("RGB"), dtype=np.float64).mean(axis=(0, 1))
        b = np.asarray(source, dtype=np.float64).mean(axis=(0, 1))
        out.append(1 - np.abs(a - b).mean() / 255 + 0.001 * source.width)
    return out

score.needs = {"images", "source_images"}
"""


def test_source_images_make_the_round_trip_through_serve_reward(tmp_path, monkeypatch):
    """The `remote` reward (declaring the server's need) against `serve-reward` serving a
    plugin that reads source images: the served scores equal the plugin's in process, each
    image scored against its own source (of its own size), across two requests."""
    (tmp_path / "rw_similar.py").write_text(SIMILARITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = batch()
    sources = [Image.new("RGB", (20 + i, 10), (40 * i, 90, 200)) for i in range(4)]
    edits = RewardBatch(plain.images, plain.prompts, None, plain.metadata, sources)
    with build_rewards({"rw_similar:score": 1.0, "jpeg_compressibility": 0.1}) as local:
        expected = local.score(edits).reward
    assert len(set(expected)) == 4
    serve = ("--reward", "rw_similar:score", "--reward", "jpeg_compressibility=0.1")
    with serving_reward(*serve, "--plugin-dir", str(tmp_path)) as url:
        with remote(url, batch_size=3, needs=["source_images"]) as rewards:
            assert rewards.score(edits).reward == pytest.approx(expected, abs=1e-12)
            with pytest.raises(FlowGrpoError, match="'remote' needs source_images"):
                rewards.score(plain)
        with remote(url, max_retries=0) as rewards, pytest.raises(FlowGrpoError) as err:
            rewards.score(plain)  # no need declared: the server answers 400 naming the field
        assert "HTTP 400" in str(err.value) and "`source_images` is missing" in str(err.value)
