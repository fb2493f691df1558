"""Untrusted input (issue 40): what a hostile tester fed flowgrpo, replayed where a user meets
it. Each probe must end in one clear line (a FlowGrpoError: the CLI prints it and exits 1; the
reward server answers 4xx with a reason) that names the file and line, the key, the URL or
the request field, and must leave nothing half made behind."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import urllib.parse
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.store.config import RemoteRewardSection, RewardSection

runner = CliRunner()


def _cli(*args: object):
    return runner.invoke(app, [str(arg) for arg in args])


def _one_line_error(result, *needles: str) -> str:
    """The CLI's error: exit 1, no traceback, the message holding every needle."""
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    text = " ".join(result.output.split())
    for needle in needles:
        assert needle in text, text
    return text


def _png(width: int, height: int) -> bytes:
    """A valid PNG of width x height black grey pixels, built by hand (a few hundred bytes
    for any size: the rows compress to almost nothing)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = zlib.compressobj(9)
    raw = rows.compress(b"\0" * (width + 1) * min(height, 64))  # a few rows suffice to refuse
    raw += rows.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _small_png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buffer, format="PNG")
    return _b64(buffer.getvalue())


# ---------------------------------------------------------------------------------------------
# 1. serve-reward: bounded requests


@pytest.fixture(scope="module")
def scorer_app():
    """The server's app with small limits, served by Starlette's TestClient."""
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from flowgrpo_cli.rewards.server import BatchingScorer, Limits, build_app

    with build_rewards({"jpeg_compressibility": 1.0}) as rewards:
        limits = Limits(max_request_mb=0.5, max_image_pixels=256 * 256, max_images=4,
                        max_json_depth=16)  # fmt: skip
        with TestClient(build_app(BatchingScorer(rewards, 64), limits)) as client:
            yield client


def _post(client, body: bytes):
    reply = client.post("/score", content=body, headers={"Content-Type": "application/json"})
    return reply.status_code, reply.json().get("error", "")


def test_server_refuses_a_body_over_the_size_limit(scorer_app):
    status, error = _post(scorer_app, b'{"images": ["' + b"A" * 2**20 + b'"]}')
    assert status == 413 and "--max-request-mb" in error and "0.5" in error


def test_server_refuses_too_many_pixels_by_the_png_header(scorer_app):
    body = json.dumps({"images": [_small_png(), _b64(_png(20000, 20000))]}).encode()
    status, error = _post(scorer_app, body)
    assert status == 400 and "images[1]" in error and "20000x20000" in error
    assert "--max-image-pixels" in error


def test_server_refuses_too_many_images(scorer_app):
    status, error = _post(scorer_app, json.dumps({"images": [_small_png()] * 5}).encode())
    assert status == 400 and "5 images" in error and "--max-images" in error


def test_server_refuses_deep_json(scorer_app):
    for depth in (17, 100_000):
        status, error = _post(scorer_app, b"[" * depth + b"]" * depth)
        assert status == 400 and "nested" in error and "--max-json-depth" in error


def test_server_request_without_prompts_is_a_400_naming_the_field(scorer_app, tmp_path):
    """A served reward that needs `prompts` (a plugin's default needs) and a request that
    does not carry them: 400 naming the field, not a 500."""
    from starlette.testclient import TestClient

    from flowgrpo_cli.rewards.server import BatchingScorer, Limits, build_app

    (tmp_path / "rw_hostile_prompted.py").write_text(
        "def score(images, prompts, metadata):\n    return [float(len(p)) for p in prompts]\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with build_rewards({"rw_hostile_prompted:score": 1.0}) as rewards:
            client = TestClient(build_app(BatchingScorer(rewards, 64), Limits()))
            status, error = _post(client, json.dumps({"images": [_small_png()]}).encode())
            assert status == 400 and "`prompts`" in error
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize(
    ("sources", "problem"),
    [
        (["abc"], "source_images[0] is not a base64-encoded image"),
        ([_b64(b"not an image at all")], "source_images[0] is not a base64-encoded image"),
        ([7], "source_images[0] is not a base64-encoded image"),
        ([], "`source_images` must be a list with one base64 image per image (1)"),
        ("abc", "`source_images` must be a list with one base64 image per image (1)"),
    ],
)  # fmt: skip
def test_server_refuses_bad_source_images(scorer_app, sources, problem):
    body = json.dumps({"images": [_small_png()], "source_images": sources}).encode()
    status, error = _post(scorer_app, body)
    assert (status, error) == (400, problem)


def test_server_refuses_source_images_past_the_pixel_limit(scorer_app):
    sources = [_small_png(), _b64(_png(20000, 20000))]
    body = json.dumps({"images": [_small_png()] * 2, "source_images": sources}).encode()
    status, error = _post(scorer_app, body)
    assert status == 400 and "source_images[1] is 20000x20000" in error
    assert "--max-image-pixels" in error


def test_server_request_without_source_images_is_a_400_naming_the_field(tmp_path):
    """A served plugin that needs source images, and a text-to-image request."""
    from starlette.testclient import TestClient

    from flowgrpo_cli.rewards.server import BatchingScorer, Limits, build_app

    (tmp_path / "rw_hostile_sourced.py").write_text(
        "def score(images, prompts, metadata, source_images):\n"
        "    return [float(s.width) for s in source_images]\n"
        "score.needs = {'images', 'source_images'}\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with build_rewards({"rw_hostile_sourced:score": 1.0}) as rewards:
            client = TestClient(build_app(BatchingScorer(rewards, 64), Limits()))
            status, error = _post(client, json.dumps({"images": [_small_png()]}).encode())
            assert status == 400
            assert error == (
                "`source_images` is missing: the served reward 'rw_hostile_sourced:score' needs it"
            )
            body = {"images": [_small_png()] * 2, "source_images": [_small_png()] * 2}
            reply = client.post("/score", content=json.dumps(body).encode())
            assert reply.status_code == 200 and reply.json()["scores"] == [8.0, 8.0]
    finally:
        sys.path.remove(str(tmp_path))


def test_server_stops_reading_past_the_limit():
    """Over a real socket: a body that declares 50 MB against a 1 MB limit is answered 413
    before the client has sent more than a fraction of it (the server does not read on)."""
    pytest.importorskip("uvicorn")
    with _served("--max-request-mb", "1") as (host, port, _):
        with socket.create_connection((host, port), timeout=20) as sock:
            sock.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 52428800\r\n\r\n"
            )
            sent = 0
            chunk = b"A" * 2**16
            sock.settimeout(5)
            with pytest.raises(OSError):  # the server answers and closes; the send then fails
                while sent < 50 * 2**20:
                    sock.sendall(chunk)
                    sent += len(chunk)
            assert sent < 50 * 2**20
            reply = b""
            with contextlib.suppress(OSError):
                while part := sock.recv(65536):
                    reply += part
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_server_chunked_body_over_the_limit_is_413():
    pytest.importorskip("uvicorn")
    with _served("--max-request-mb", "1") as (host, port, _):
        import http.client

        connection = http.client.HTTPConnection(host, port, timeout=20)

        def chunks():
            for _ in range(40):
                yield b"A" * 2**16

        connection.request("POST", "/score", body=chunks(), encode_chunked=True,
                           headers={"Content-Type": "application/json"})  # fmt: skip
        reply = connection.getresponse()
        assert reply.status == 413 and "--max-request-mb" in json.loads(reply.read())["error"]


def test_server_disconnect_mid_body_is_one_log_line():
    pytest.importorskip("uvicorn")
    with _served() as (host, port, process):
        with socket.create_connection((host, port), timeout=20) as sock:
            sock.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n" + b"A" * 1000
            )
        # Then a normal request, so the server has surely handled the disconnect.
        import http.client

        connection = http.client.HTTPConnection(host, port, timeout=20)
        body = json.dumps({"images": [_small_png()], "prompts": ["a"]}).encode()
        connection.request("POST", "/score", body, {"Content-Type": "application/json"})
        assert connection.getresponse().status == 200
    log = process.stderr.read()
    assert "Traceback" not in log, log
    assert log.count("disconnected") == 1, log


@contextlib.contextmanager
def _served(*options: str, host: str = "127.0.0.1") -> Iterator[tuple[str, int, subprocess.Popen]]:
    """`flowgrpo serve-reward` with jpeg_compressibility on a free port: (host, port, process);
    the printed URL is parsed as a client would (urllib)."""
    import signal

    process = subprocess.Popen(
        [sys.executable, "-m", "flowgrpo_cli", "serve-reward", "--port", "0", "--host", host,
         "--reward", "jpeg_compressibility", *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        assert "serving" in line, line + process.stderr.read()
        url = urllib.parse.urlsplit(line.split(" at ")[-1].strip())
        assert url.hostname == host, line
        yield host, url.port, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_serve_reward_port_out_of_range_is_one_line():
    result = _cli("serve-reward", "--reward", "jpeg_compressibility", "--port", "99999")
    _one_line_error(result, "--port 99999", "0..65535")


@pytest.mark.parametrize("option", ["--max-request-mb", "--max-image-pixels", "--max-images",
                                    "--max-json-depth"])  # fmt: skip
def test_serve_reward_limits_must_be_positive(option):
    result = _cli("serve-reward", "--reward", "jpeg_compressibility", option, "0")
    _one_line_error(result, option)


def test_serve_reward_on_ipv6_prints_a_bracketed_url():
    pytest.importorskip("uvicorn")
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("::1 is not available")
    with _served(host="::1") as (_, port, _process):  # it parses the printed URL
        import http.client

        connection = http.client.HTTPConnection("::1", port, timeout=20)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200


def test_printed_ipv6_url_is_bracketed():
    from flowgrpo_cli.rewards.server import url_of

    assert url_of("::1", 8000) == "http://[::1]:8000/score"
    assert url_of("127.0.0.1", 8000) == "http://127.0.0.1:8000/score"


# ---------------------------------------------------------------------------------------------
# 2. remote reward replies and URLs


class _Reply:
    body = b""


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(_Reply.body)))
        self.end_headers()
        self.wfile.write(_Reply.body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def reply_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def _gray_batch(count: int = 2) -> RewardBatch:
    images = [Image.new("RGB", (8, 8), (i, i, i)) for i in range(count)]
    return RewardBatch(images, ["p"] * count, None, [{"sample_id": str(i)} for i in range(count)])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"scores": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested"),
        (b'{"scores": [' + b"7" * 5000 + b", 1]}", "digits"),
    ],
    ids=["deep", "long-number"],
)
def test_hostile_replies_are_errors_naming_the_url(reply_server, body, message):
    _Reply.body = body
    settings = RewardSection(remote=RemoteRewardSection(url=reply_server, max_retries=0))
    with (
        build_rewards({"remote": 1.0}, settings) as rewards,
        pytest.raises(FlowGrpoError) as caught,
    ):
        rewards.score(_gray_batch())
    assert reply_server in str(caught.value) and message in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://",
        "http://[::1",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:abc",
        "https:///score",
    ],
)
def test_bad_remote_urls_are_config_errors(tmp_path, url):
    config = tmp_path / "bad.toml"
    config.write_text(f'[reward.weights]\nremote = 1.0\n[reward.remote]\nurl = "{url}"\n')
    result = _cli("config", "--config", config)
    _one_line_error(result, "reward.remote.url")


BAD_URL = "http://127.0.0.1:abc"


def test_bad_remote_url_is_refused_when_the_reward_is_built():
    with pytest.raises(FlowGrpoError, match=r"reward\.remote\.url"):
        build_rewards({"remote": 1.0}, RewardSection(remote=RemoteRewardSection(url=BAD_URL)))


def test_remote_deadline_bounds_a_batch():
    """A server that always fails would be retried for max_retries x (timeout_s + backoff);
    the batch's deadline stops it first, with an error naming the key."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/score"  # bound, not listening
        remote = RemoteRewardSection(url=dead, max_retries=1000, backoff_s=0.05, deadline_s=0.2)
        with (
            build_rewards({"remote": 1.0}, RewardSection(remote=remote)) as rewards,
            pytest.raises(FlowGrpoError) as caught,
        ):
            rewards.score(_gray_batch())
    assert "deadline_s" in str(caught.value) and dead in str(caught.value)


def test_remote_deadline_is_a_config_key(tmp_path):
    from flowgrpo_cli.store.config import load_config

    config = tmp_path / "c.toml"
    config.write_text('[reward.remote]\nurl = "http://127.0.0.1:1/score"\ndeadline_s = 0\n')
    with pytest.raises(FlowGrpoError, match="deadline_s"):
        load_config(config)


# ---------------------------------------------------------------------------------------------
# 3. prompt files


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
        ('{"prompt": "a", "n": ' + "9" * 5000 + "}", "digits"),
        ('{"prompt": "a sign that says \\"\\ud800\\""}', "surrogate"),
    ],
    ids=["deep", "long-number", "lone-surrogate"],
)
def test_hostile_jsonl_rows_are_errors_at_their_line(tmp_path, line, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a sign that says \\"OK\\""}\n' + line + "\n")
    run = tmp_path / "run"
    result = _cli("prepare", "--run", run, "--train", prompts, "--test-fraction", "0")
    _one_line_error(result, f"{prompts}:2", message)
    # Nothing half made: the next prepare (with the bad line gone) just works.
    prompts.write_text('{"prompt": "a sign that says \\"OK\\""}\n' * 2)
    result = _cli("prepare", "--run", run, "--train", prompts, "--test-fraction", "0")
    assert result.exit_code == 0, result.output


def test_lone_surrogate_skipped_as_invalid(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "\\"OK\\""}\n{"prompt": "\\"\\udc00\\""}\n')
    result = _cli("prepare", "--run", tmp_path / "run", "--train", prompts,
                  "--test-fraction", "0", "--skip-invalid")  # fmt: skip
    assert result.exit_code == 0, result.output


def test_a_long_csv_field_is_read(tmp_path):
    prompts = tmp_path / "p.csv"
    long = "x" * 200_000
    prompts.write_text(f'prompt\n"a sign that says ""OK"" {long}"\n"a sign that says ""HI"""\n')
    result = _cli("prepare", "--run", tmp_path / "run", "--train", prompts, "--test-fraction", "0")
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------------------------------------
# 4. metrics files


@pytest.mark.parametrize(
    "bad", ["{not json", "[1, 2]", '{"iteration": ' + "9" * 5000 + "}", "[" * 100_000]
)
def test_corrupt_metrics_log_in_report_names_file_and_line(tmp_path, bad):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0, "reward/mean": 0.5}\n' + bad + "\n")
    result = _cli("report", tmp_path)
    _one_line_error(result, f"{tmp_path / 'metrics.jsonl'}:2")


# ---------------------------------------------------------------------------------------------
# 5. plugins


HOSTILE_PLUGINS = """
import os
import time

import numpy as np


def exits(images, prompts, metadata):
    os._exit(0)


def column(images, prompts, metadata):
    return np.ones((len(images), 1))


def matrix(images, prompts, metadata):
    return np.ones((len(images), 2))


def a_dict(images, prompts, metadata):
    return {"a": 1.0}


def a_string(images, prompts, metadata):
    return "1" * len(images)


def sleeps(images, prompts, metadata):
    time.sleep(600)
    return [1.0] * len(images)


def fine(images, prompts, metadata):
    return [float(i) for i in range(len(images))]
"""


@pytest.fixture
def hostile_plugins(tmp_path, monkeypatch) -> Path:
    (tmp_path / "rw_hostile.py").write_text(textwrap.dedent(HOSTILE_PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("exits", "process ended"),
        ("matrix", "shape (2, 2)"),
        ("a_dict", "returned a dict"),
        ("a_string", "returned a str"),
    ],
)
def test_hostile_plugins_are_errors_naming_them(hostile_plugins, function, message):
    spec = f"rw_hostile:{function}"
    with build_rewards({spec: 1.0}) as rewards, pytest.raises(FlowGrpoError) as caught:
        rewards.score(_gray_batch())
    assert repr(spec) in str(caught.value) and message in str(caught.value)


def test_a_column_of_scores_is_flattened(hostile_plugins):
    with build_rewards({"rw_hostile:column": 1.0}) as rewards:
        assert rewards.score(_gray_batch()).reward == [1.0, 1.0]


def test_a_hanging_plugin_times_out(hostile_plugins):
    rewards = build_rewards({"rw_hostile:sleeps": 1.0}, RewardSection(plugin_timeout_s=0.5))
    with rewards, pytest.raises(FlowGrpoError) as caught:
        rewards.score(_gray_batch())
    assert "'rw_hostile:sleeps'" in str(caught.value) and "plugin_timeout_s" in str(caught.value)


def test_a_plugin_worker_is_reused_and_closed(hostile_plugins):
    with build_rewards({"rw_hostile:fine": 1.0}) as rewards:
        assert rewards.score(_gray_batch(3)).reward == [0.0, 1.0, 2.0]
        worker = rewards._rewards[0]._worker
        assert rewards.score(_gray_batch(2)).reward == [0.0, 1.0]
        assert rewards._rewards[0]._worker is worker and worker.is_alive()
    assert not worker.is_alive()


def test_plugin_that_exits_ends_the_loop_with_an_error(tmp_path):
    """Through the CLI: `flowgrpo reward` with a plugin calling os._exit(0) is exit 1 and a
    message, not exit 0 and silence."""
    (tmp_path / "rw_hostile.py").write_text(textwrap.dedent(HOSTILE_PLUGINS))
    image = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    result = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "reward", "--reward", "rw_hostile:exits",
         "--prompt", "p", str(image)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "rw_hostile:exits" in result.stderr and "Traceback" not in result.stderr


def test_plugin_timeout_is_a_config_key(tmp_path):
    from flowgrpo_cli.store.config import load_config

    config = tmp_path / "c.toml"
    config.write_text("[reward]\nplugin_timeout_s = -1\n")
    with pytest.raises(FlowGrpoError, match="plugin_timeout_s"):
        load_config(config)
    config.write_text("[reward]\nplugin_timeout_s = 5\n")
    assert load_config(config).reward.plugin_timeout_s == 5
