"""The `remote` reward against a real HTTP server on localhost, well-behaved and not."""

import base64
import io
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from helpers import http_server
from PIL import Image, ImageStat

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.rewards.remote import RemoteReward
from flowgrpo_cli.store.config import RemoteRewardSection, RewardSection, load_config


@dataclass
class Behaviour:
    """What the test server does; `replies` are used in turn, the last one repeated."""

    replies: list[Any] = field(default_factory=lambda: ["brightness"])
    delay_s: float = 0.0
    trickle_s: float = 0.0  # > 0: send the reply a byte at a time, this far apart
    requests: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)


def brightness(b64_png: str) -> float:
    image = Image.open(io.BytesIO(base64.b64decode(b64_png)))
    return ImageStat.Stat(image.convert("L")).mean[0] / 255.0


class Handler(BaseHTTPRequestHandler):
    behaviour: Behaviour

    def do_POST(self) -> None:
        behaviour = self.server.state  # type: ignore[attr-defined]
        behaviour.arrivals.append(time.monotonic())
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        behaviour.requests.append(request)
        reply = behaviour.replies[min(len(behaviour.requests), len(behaviour.replies)) - 1]
        time.sleep(behaviour.delay_s)
        status, body = 200, reply
        if reply == "brightness":  # a real scorer: decodes every PNG
            body = json.dumps({"scores": [brightness(png) for png in request["images"]]})
        elif isinstance(reply, int):
            status, body = reply, f"server error {reply}"
        elif not isinstance(reply, str):
            body = json.dumps(reply)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            if behaviour.trickle_s:
                for byte in body.encode():
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(behaviour.trickle_s)
            else:
                self.wfile.write(body.encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting: that is what the timeout tests want

    def log_message(self, *args: Any) -> None:
        """Keep the test output clean."""


@pytest.fixture
def server() -> Iterator[tuple[str, Behaviour]]:
    behaviour = Behaviour()
    with http_server(Handler, behaviour) as url:
        yield f"{url}/score", behaviour


def gray(level: int) -> Image.Image:
    return Image.new("RGB", (16, 8), (level, level, level))


def batch(count: int) -> RewardBatch:
    levels = [0, 51, 102, 153, 204, 255][:count]
    return RewardBatch(
        images=[gray(level) for level in levels],
        prompts=[f"prompt {i}" for i in range(count)],
        ground_truths=[f"text {i}" for i in range(count)],
        metadata=[{"sample_id": f"s{i}", "group_id": i // 2} for i in range(count)],
    )


def remote(url: str, **options: Any) -> RemoteReward:
    options = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, **options}
    return RemoteReward(RemoteRewardSection(url=url, **options))


def test_scores_come_back_in_order_across_batches(server):
    url, behaviour = server
    output = remote(url, batch_size=2).score(batch(5))
    assert [s.value for s in output.scores] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    assert [len(request["images"]) for request in behaviour.requests] == [2, 2, 1]
    last = behaviour.requests[2]
    assert last["prompts"] == ["prompt 4"]
    assert last["ground_truths"] == ["text 4"]
    assert last["metadata"] == [{"sample_id": "s4", "group_id": 2}]


def test_through_build_rewards_and_the_weighted_total(server):
    url, _ = server
    settings = RewardSection(remote=RemoteRewardSection(url=url))
    with build_rewards({"remote": 0.5}, settings) as rewards:
        result = rewards.score(batch(2))
    assert result.columns["remote"] == pytest.approx([0.0, 0.2])
    assert result.reward == pytest.approx([0.0, 0.1])


def test_per_image_errors_and_non_numbers(server):
    url, behaviour = server
    behaviour.replies = [
        {
            "scores": [0.5, None, "high", float("nan"), True, 0.25],
            "errors": [None, "no face found", None, None, None, None],
        }
    ]
    scores = remote(url).score(batch(6)).scores
    assert [s.value for s in scores] == [0.5, None, None, None, None, 0.25]
    assert scores[1].error == "server: no face found"
    assert scores[2].error == "returned 'high', not a number"
    assert scores[3].error == "returned nan"
    assert scores[4].error == "returned True, not a number"


def test_null_score_without_a_message_is_an_error(server):
    url, behaviour = server
    behaviour.replies = [{"scores": [None]}]
    assert remote(url).score(batch(1)).scores[0].error == "server sent a null score and no error"


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ({"scores": [1.0, 2.0]}, '2 "scores" for 3 images'),
        ({"scores": [1.0, 2.0, 3.0], "errors": [None]}, '1 "errors" for 3 images'),
        ("<html>oops</html>", "the reply is not JSON"),
        ({"score": [1, 2, 3]}, 'expected a JSON object {"scores": [...]}'),
        ([1, 2, 3], 'expected a JSON object {"scores": [...]}'),
        ({"scores": [1, 2, 3], "errors": "bad"}, '"errors" must be a list'),
    ],
)
def test_malformed_replies_are_clear_errors(server, reply, message):
    url, behaviour = server
    behaviour.replies = [reply]
    with pytest.raises(FlowGrpoError, match=re.escape(message)) as caught:
        remote(url).score(batch(3))
    assert url in str(caught.value) and "images 0..2" in str(caught.value)
    assert len(behaviour.requests) == 1  # a malformed reply is not retried


def test_server_error_is_retried_with_exponential_backoff_then_fails(server):
    url, behaviour = server
    behaviour.replies = [500]
    with pytest.raises(FlowGrpoError, match="no reply after 4 attempt") as caught:
        remote(url, max_retries=3, backoff_s=0.05).score(batch(1))
    assert "HTTP 500" in str(caught.value) and "server error 500" in str(caught.value)
    assert len(behaviour.requests) == 4
    gaps = [b - a for a, b in zip(behaviour.arrivals, behaviour.arrivals[1:], strict=False)]
    for gap, wait in zip(gaps, [0.05, 0.1, 0.2], strict=True):
        assert gap >= wait * 0.95


def test_a_retry_that_succeeds_gives_the_scores(server):
    url, behaviour = server
    behaviour.replies = [503, "brightness"]
    assert [s.value for s in remote(url).score(batch(2)).scores] == pytest.approx([0.0, 0.2])
    assert len(behaviour.requests) == 2


def test_client_error_is_not_retried(server):
    url, behaviour = server
    behaviour.replies = [400]
    with pytest.raises(FlowGrpoError, match=r"HTTP 400 .*server error 400"):
        remote(url).score(batch(1))
    assert len(behaviour.requests) == 1


def test_slow_server_times_out_each_attempt_then_fails(server):
    url, behaviour = server
    behaviour.delay_s = 0.5
    start = time.monotonic()
    with pytest.raises(FlowGrpoError, match=r"no reply after 3 attempt.*timed out") as caught:
        remote(url, timeout_s=0.1, max_retries=2).score(batch(1))
    assert "timeout_s = 0.1" in str(caught.value)
    assert len(behaviour.requests) == 3
    assert time.monotonic() - start < 0.5 * 3  # gave up on each attempt before the server


def test_a_trickling_reply_ends_at_the_deadline_of_its_attempt(server):
    """Each read gets a byte well within timeout_s; only a deadline per reply stops it."""
    url, behaviour = server
    behaviour.replies = [json.dumps({"scores": [0.5]}) + " " * 1000]
    behaviour.trickle_s = 0.05
    start = time.monotonic()
    with pytest.raises(FlowGrpoError, match=r"no reply after 2 attempt.*within 0.4 s"):
        remote(url, timeout_s=0.4, max_retries=1).score(batch(1))
    assert time.monotonic() - start < 2 * 0.4 + 1.0  # 1000+ bytes would take 50 s


def test_a_reply_over_the_size_cap_is_refused_and_not_retried(server):
    url, behaviour = server
    behaviour.replies = [{"scores": [0.5], "padding": "x" * 2_000_000}]
    with pytest.raises(FlowGrpoError, match=r"reply is too large .* max_reply_mb = 1"):
        remote(url, max_reply_mb=1).score(batch(1))
    assert len(behaviour.requests) == 1
    assert [s.value for s in remote(url, max_reply_mb=3).score(batch(1)).scores] == [0.5]


def test_no_server_is_retried_then_a_clear_error():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{httpd.server_port}/score"
    httpd.server_close()  # nothing listens on that port any more
    with pytest.raises(FlowGrpoError, match=r"no reply after 3 attempt.*is the server up"):
        remote(url).score(batch(1))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "localhost:8000/score"}, "expected an http:// or https:// URL"),
        ({"url": "http://x", "timeout_s": 0}, "timeout_s` = 0 must be > 0"),
        ({"url": "http://x", "max_retries": -1}, "max_retries` = -1 must be >= 0"),
        ({"url": "http://x", "batch_size": 0}, "batch_size` = 0 must be >= 1"),
        ({"url": "http://x", "backoff_s": -1.0}, "backoff_s` = -1.0 must be >= 0"),
        ({"url": "http://x", "max_reply_mb": 0}, "max_reply_mb` = 0 must be > 0"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(FlowGrpoError, match=message):
        RemoteRewardSection(**options)
    # The config's own check, in the same words, with where the value was set.
    overrides = [f"reward.remote.{key}={json.dumps(value)}" for key, value in options.items()]
    with pytest.raises(FlowGrpoError, match=rf"--set reward\.remote\..*{message}"):
        load_config(None, overrides)


# --- source images (an editing data set) ------------------------------------------------------


def test_a_text_to_image_request_is_the_same_bytes_as_before_source_images():
    """No `source_images` key at all: the request an old server already reads, byte for byte
    the format's four fields as they were written before the field existed."""
    from flowgrpo_cli.rewards.remote import encode_png, encode_request

    chunk = batch(3)
    before = {
        "images": [encode_png(image) for image in chunk.images],
        "prompts": chunk.prompts,
        "ground_truths": chunk.ground_truths,
        "metadata": chunk.metadata,
    }
    assert encode_request(chunk) == json.dumps(before).encode("utf-8")


def test_source_images_go_one_per_image_in_order(server):
    url, behaviour = server
    shared, other = gray(30), Image.new("RGB", (5, 7), (1, 2, 3))  # the sources' own sizes
    chunk = batch(3)
    edits = RewardBatch(
        chunk.images, chunk.prompts, chunk.ground_truths, chunk.metadata,
        source_images=[shared, other, shared],
    )  # fmt: skip
    result = remote(url, batch_size=2).score(edits)  # two requests: 2 images, then 1
    assert [score.value for score in result.scores] == [0.0, pytest.approx(0.2), 0.4]
    first, second = behaviour.requests
    assert list(first) == ["images", "prompts", "ground_truths", "metadata", "source_images"]
    sent = [
        Image.open(io.BytesIO(base64.b64decode(text)))
        for request in (first, second)
        for text in request["source_images"]
    ]
    assert [image.size for image in sent] == [(16, 8), (5, 7), (16, 8)]
    for image, source in zip(sent, [shared, other, shared], strict=True):
        assert image.format == "PNG" and image.convert("RGB").tobytes() == source.tobytes()


def test_needs_declare_what_the_server_reads():
    from flowgrpo_cli.rewards.registry import reward_needs

    assert reward_needs("remote") == {"images", "prompts"}
    settings = RewardSection(remote=RemoteRewardSection(url="http://x", needs=["source_images"]))
    assert reward_needs("remote", settings) == {"images", "prompts", "source_images"}
    with build_rewards({"remote": 1.0}, settings) as rewards:
        assert rewards.needs == {"remote": {"images", "prompts", "source_images"}}
        with pytest.raises(FlowGrpoError, match="'remote' needs source_images"):
            rewards.score(batch(1))  # a text batch: refused before any request
    with pytest.raises(FlowGrpoError, match=r"names 'sources': expected any of ground_truths"):
        load_config(None, ['reward.remote.needs=["sources"]'])
    # Unset, the key leaves the config hash as it was.
    from flowgrpo_cli.store.config import config_hash

    assert config_hash(load_config(None)) == config_hash(
        load_config(None, ["reward.remote.needs=[]"])
    )


def test_remote_without_a_url_is_a_config_error():
    with pytest.raises(FlowGrpoError, match=r"set \[reward.remote\] url"):
        build_rewards({"remote": 1.0})
