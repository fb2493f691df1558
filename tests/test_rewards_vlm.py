"""The `vlm` judge against a real HTTP server on localhost that speaks the chat-completions
API with canned replies: how replies become scores, what the server is sent, and how broken
servers and unreadable replies are reported."""

import base64
import io
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from helpers import http_server, serving_reward
from PIL import Image
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.rewards.vlm import VlmReward, build_vlm, chat_url, yes_probability
from flowgrpo_cli.store.config import (
    RemoteRewardSection,
    RewardSection,
    VlmRewardSection,
    load_config,
)


def completion(text: str | None, tokens: list | None = None, finish: str = "stop") -> dict:
    """A chat completion as vLLM writes one; `tokens`: its logprobs.content."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
    }
    if tokens is not None:
        choice["logprobs"] = {"content": tokens}
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "judge", "choices": [choice]}


def token(text: str, probability: float, top: dict[str, float]) -> dict:
    """One generated token with its top alternatives, given as probabilities."""
    alternatives = [{"token": t, "logprob": math.log(p), "bytes": None} for t, p in top.items()]
    return {"token": text, "logprob": math.log(probability), "top_logprobs": alternatives}


@dataclass
class Judge:
    """What the test server does. `answer(request)` gives the reply to one request: a dict
    (sent as JSON), a str (sent as it is) or an int (that HTTP status); `script`, if set,
    is used in turn instead, its last entry repeated."""

    answer: Callable[[dict], Any] = lambda request: completion("5")
    script: list[Any] = field(default_factory=list)
    delay_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        judge: Judge = self.server.state  # type: ignore[attr-defined]
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with judge.lock:
            judge.requests.append(request)
            judge.paths.append(self.path)
            judge.headers.append(dict(self.headers))
            turn = len(judge.requests)
            judge.in_flight += 1
            judge.most_in_flight = max(judge.most_in_flight, judge.in_flight)
        time.sleep(judge.delay_s)
        with judge.lock:
            judge.in_flight -= 1
        if judge.script:
            reply = judge.script[min(turn, len(judge.script)) - 1]
        else:
            reply = judge.answer(request)
        status, body = 200, reply
        if isinstance(reply, int):
            status, body = reply, json.dumps({"object": "error", "message": f"boom {reply}"})
        elif not isinstance(reply, str):
            body = json.dumps(reply)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting: what the deadline test wants

    def log_message(self, *args: Any) -> None:
        """Keep the test output clean."""


@pytest.fixture
def server() -> Iterator[tuple[str, Judge]]:
    judge = Judge()
    with http_server(Handler, judge) as url:
        yield url, judge


def image(seed: int) -> Image.Image:
    """A 12 x 8 image whose every pixel differs: a lossy or resized upload would show."""
    pixels = bytes((seed * 7 + i * 31) % 256 for i in range(12 * 8 * 3))
    return Image.frombytes("RGB", (12, 8), pixels)


def batch(prompts: list[str], targets: list[str | None] | None = None) -> RewardBatch:
    count = len(prompts)
    return RewardBatch(
        images=[image(i) for i in range(count)],
        prompts=prompts,
        ground_truths=targets if targets is not None else [None] * count,
        metadata=[{"sample_id": f"s{i}", "group_id": 0} for i in range(count)],
    )


def judge(url: str, **options: Any) -> VlmReward:
    options = {"model": "judge", "timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, **options}
    return VlmReward(VlmRewardSection(url=url, **options))


def text_of(request: dict) -> str:
    return request["messages"][0]["content"][-1]["text"]


def sent_images(request: dict) -> list[Image.Image]:
    """The images of a request's message, in order, decoded from their PNG data URLs."""
    out = []
    for part in request["messages"][0]["content"][:-1]:
        assert part["type"] == "image_url"
        prefix, data = part["image_url"]["url"].split(",", 1)
        assert prefix == "data:image/png;base64"
        out.append(Image.open(io.BytesIO(base64.b64decode(data))))
    return out


def by_prompt(replies: dict[str, Any]) -> Callable[[dict], Any]:
    """Answers each request by the prompt its question holds (requests arrive in any order)."""

    def answer(request: dict) -> Any:
        return next(reply for prompt, reply in replies.items() if prompt in text_of(request))

    return answer


# --- parse = "number" -----------------------------------------------------------------------


def test_numbers_are_mapped_from_the_range_to_0_1(server):
    url, behaviour = server
    behaviour.answer = by_prompt({
        "cat": completion("7"),                       # (7 - 0) / (10 - 0) = 0.7
        "dog": completion("Score: 2.5 out of 10"),    # the first number: 2.5 / 10 = 0.25
        "cow": completion("10"),                      # the top of the range: 1.0
        "pig": completion("0 - it shows nothing"),    # the bottom: 0.0
    })  # fmt: skip
    output = judge(url).score(batch(["cat", "dog", "cow", "pig"]))
    assert [s.value for s in output.scores] == pytest.approx([0.7, 0.25, 1.0, 0.0])
    assert output.details["reply"][1] == "Score: 2.5 out of 10"


def test_unified_reward_final_score_after_its_reasoning(server):
    """UnifiedReward reasons first, then writes "Final Score: N" on a 1..5 scale."""
    url, behaviour = server
    reply = (
        "You ask for a final score: 1 to 5.\n1. Alignment: the cat is there.\n"
        "2. Quality: sharp.\nFinal Score: 4"
    )
    behaviour.answer = lambda request: completion(reply)
    after = judge(url, score_range=[1, 5], number_after="final score:")
    # (4 - 1) / (5 - 1) = 0.75: the number after the marker's last occurrence, in any case
    assert after.score(batch(["a cat"])).scores[0].value == pytest.approx(0.75)
    # Without the marker the first number is the "1" of "1 to 5": (1 - 1) / 4 = 0
    assert judge(url, score_range=[1, 5]).score(batch(["a cat"])).scores[0].value == 0.0


def test_unreadable_numbers_fail_their_image_only(server):
    url, behaviour = server
    behaviour.answer = by_prompt({
        "cat": completion("8"),
        "dog": completion("I cannot judge this image."),
        "cow": completion("11"),
        "pig": completion("The image shows a", finish="length"),
        "hen": completion(None),  # no content at all
    })  # fmt: skip
    scores = judge(url).score(batch(["cat", "dog", "cow", "pig", "hen"])).scores
    assert scores[0].value == pytest.approx(0.8)
    assert [s.value for s in scores[1:]] == [None] * 4
    assert scores[1].error == "no number in the reply 'I cannot judge this image.'"
    assert scores[2].error == ("11 in the reply '11' is outside reward.vlm.score_range [0, 10]")
    assert "cut off at reward.vlm.max_tokens" in scores[3].error
    assert scores[4].error == "no number in the reply ''"


def test_a_missing_marker_fails_the_image(server):
    url, behaviour = server
    behaviour.answer = lambda request: completion("Score: 4")
    score = judge(url, number_after="Final Score:").score(batch(["a"])).scores[0]
    assert score.error == "no 'Final Score:' (reward.vlm.number_after) in the reply 'Score: 4'"


# --- parse = "yes_no" -----------------------------------------------------------------------


def test_p_yes_from_the_first_answer_tokens_logprobs(server):
    url, behaviour = server
    behaviour.answer = by_prompt({
        # P(yes) = (0.6 + 0.1) / (0.6 + 0.1 + 0.2) = 0.7 / 0.9 = 7/9; "Maybe" is neither
        "cat": completion("Yes", [
            token("Yes", 0.6, {"Yes": 0.6, "No": 0.2, "yes": 0.1, "Maybe": 0.1}),
        ]),
        # P(yes) = 0.125 / (0.5 + 0.25 + 0.125) = 0.125 / 0.875 = 1/7
        "dog": completion("No.", [
            token("No", 0.5, {"No": 0.5, " no": 0.25, "YES": 0.125, "The": 0.0625}),
            token(".", 0.9, {".": 0.9}),
        ]),
        # The answer token is the first that reads yes or no, here the fourth:
        # P(yes) = 0.9 / (0.9 + 0.05) = 18/19
        "cow": completion("The answer is yes.", [
            token("The", 0.8, {"The": 0.8, "Yes": 0.1}),
            token(" answer", 0.9, {" answer": 0.9}),
            token(" is", 0.9, {" is": 0.9}),
            token(" yes", 0.9, {" yes": 0.9, " no": 0.05, " maybe": 0.05}),
            token(".", 0.9, {".": 0.9}),
        ]),
    })  # fmt: skip
    output = judge(url, parse="yes_no").score(batch(["cat", "dog", "cow"]))
    assert [s.value for s in output.scores] == pytest.approx([7 / 9, 1 / 7, 18 / 19])


def test_p_yes_of_tiny_probabilities_does_not_underflow():
    # e^-1000 and e^-1001 are both 0.0 in float64, yet their ratio is exact:
    # P(yes) = e^-1000 / (e^-1000 + e^-1001) = 1 / (1 + e^-1) = 0.7310585786300049
    tokens = [{
        "token": "yes", "logprob": -1000.0,
        "top_logprobs": [{"token": "yes", "logprob": -1000.0}, {"token": "no", "logprob": -1001.0}],
    }]  # fmt: skip
    assert yes_probability(tokens) == pytest.approx(1 / (1 + math.exp(-1)))
    # The chosen token counts even when the server lists no alternatives (top_logprobs 0)
    assert yes_probability([{"token": "No", "logprob": -0.1, "top_logprobs": []}]) == 0.0


def test_no_yes_or_no_token_fails_the_image(server):
    url, behaviour = server
    behaviour.answer = lambda request: completion("Maybe", [token("Maybe", 0.7, {"Maybe": 0.7})])
    score = judge(url, parse="yes_no").score(batch(["a"])).scores[0]
    assert score.error == "no token of the reply 'Maybe' reads yes or no"


def test_without_logprobs_an_error_or_the_text_fallback(server):
    url, behaviour = server
    behaviour.answer = by_prompt({
        "cat": completion("Yes, it does."), "dog": completion("no"), "cow": completion("Unsure"),
    })  # fmt: skip
    with pytest.raises(FlowGrpoError, match=r"no log-probabilities .* text_fallback = true"):
        judge(url, parse="yes_no").score(batch(["cat"]))
    scores = judge(url, parse="yes_no", text_fallback=True).score(batch(["cat", "dog", "cow"]))
    assert [s.value for s in scores.scores] == [1.0, 0.0, None]
    assert scores.scores[2].error == "no yes or no in the reply 'Unsure'"


# --- what the server receives ---------------------------------------------------------------


def test_the_request_holds_the_model_the_filled_template_and_the_image(server, monkeypatch):
    url, behaviour = server
    monkeypatch.setenv("JUDGE_KEY", "secret-123")
    behaviour.answer = lambda request: completion("Yes", [token("Yes", 0.9, {"Yes": 0.9})])
    settings = RewardSection(
        vlm=VlmRewardSection(
            url=url, model="Qwen2.5-VL-7B-Instruct", api_key_env="JUDGE_KEY",
            template='Does it show "{prompt}" with the text {ground_truth}? {{yes/no}}',
            parse="yes_no", top_logprobs=5, max_tokens=4,
        )
    )  # fmt: skip
    reward = build_vlm(settings)
    assert reward.needs == {"images", "prompts", "ground_truths"}
    reward.score(batch(["a shop sign"], ["OPEN"]))
    (request,) = behaviour.requests
    assert behaviour.paths == ["/v1/chat/completions"]
    assert behaviour.headers[0]["Authorization"] == "Bearer secret-123"
    assert request["model"] == "Qwen2.5-VL-7B-Instruct"
    assert (request["max_tokens"], request["temperature"]) == (4, 0.0)
    assert (request["logprobs"], request["top_logprobs"]) == (True, 5)
    (message,) = request["messages"]
    assert message["role"] == "user"
    picture, question = message["content"]
    assert question == {
        "type": "text", "text": 'Does it show "a shop sign" with the text OPEN? {yes/no}'
    }  # fmt: skip
    assert picture["type"] == "image_url"
    prefix, data = picture["image_url"]["url"].split(",", 1)
    assert prefix == "data:image/png;base64"
    sent = Image.open(io.BytesIO(base64.b64decode(data)))
    assert sent.format == "PNG" and sent.size == (12, 8)
    assert sent.convert("RGB").tobytes() == image(0).tobytes()
    assert "secret-123" not in json.dumps(reward.info)


def test_number_requests_ask_for_no_logprobs_and_need_no_target(server):
    url, behaviour = server
    reward = judge(url + "/v1")  # an OpenAI client's base URL works too
    assert reward.needs == {"images", "prompts"}
    reward.score(batch(["a"]))
    assert behaviour.paths == ["/v1/chat/completions"]
    assert "logprobs" not in behaviour.requests[0] and "Authorization" not in behaviour.headers[0]


def test_an_image_without_a_target_fails_and_is_not_sent(server):
    url, behaviour = server
    reward = judge(url, template="Is the text {ground_truth} legible? Score 0-10.")
    scores = reward.score(batch(["a", "b"], ["OPEN", None])).scores
    assert scores[0].value == pytest.approx(0.5)  # the default canned reply "5"
    assert scores[1].error == (
        "no target text for this image, and reward.vlm.template asks for {ground_truth}"
    )
    assert len(behaviour.requests) == 1


COMPARE = (
    "The first image is the original, the second the result of the edit '{prompt}'. "
    "Is everything the edit does not ask for unchanged? Score 0-10."
)


def edits(prompts: list[str]) -> RewardBatch:
    """`batch(prompts)` with a source image per image, each of another size than its result."""
    plain = batch(prompts)
    sources = [image(10 + i).resize((6 + i, 5)) for i in range(len(prompts))]
    return RewardBatch(plain.images, plain.prompts, plain.ground_truths, plain.metadata, sources)


def test_with_source_image_sends_the_source_first_and_the_result_second(server):
    url, behaviour = server
    behaviour.answer = by_prompt({"'sky'": completion("2"), "'cat'": completion("9")})
    reward = judge(url, with_source_image=True, template=COMPARE)
    assert reward.needs == {"images", "prompts", "source_images"}
    chunk = edits(["sky", "cat"])
    result = reward.score(chunk)
    assert [score.value for score in result.scores] == [pytest.approx(0.2), pytest.approx(0.9)]
    for request in behaviour.requests:
        index = 0 if "'sky'" in text_of(request) else 1
        source, edited = sent_images(request)
        assert source.format == edited.format == "PNG"
        assert source.size == chunk.source_images[index].size  # as the data set gave it
        assert source.convert("RGB").tobytes() == chunk.source_images[index].tobytes()
        assert edited.convert("RGB").tobytes() == chunk.images[index].tobytes()
        assert text_of(request).startswith("The first image is the original")
    # Without the option the same batch sends the result alone, as before.
    behaviour.requests.clear()
    judge(url, template=COMPARE).score(edits(["sky"]))
    (alone,) = sent_images(behaviour.requests[0])
    assert alone.convert("RGB").tobytes() == image(0).tobytes()


def test_with_source_image_needs_an_editing_data_set_and_its_own_template(server):
    from flowgrpo_cli.rewards.registry import reward_needs

    url, _ = server
    settings = RewardSection(
        vlm=VlmRewardSection(url=url, model="judge", with_source_image=True, template=COMPARE)
    )
    assert reward_needs("vlm", settings) == {"images", "prompts", "source_images"}
    assert reward_needs("vlm") == {"images", "prompts"}
    with (
        build_rewards({"vlm": 1.0}, settings) as rewards,
        pytest.raises(FlowGrpoError, match="'vlm' needs source_images"),
    ):
        rewards.score(batch(["a text prompt"]))
    default = RewardSection(vlm=VlmRewardSection(url=url, model="judge", with_source_image=True))
    with pytest.raises(FlowGrpoError, match="template is the default question about one image"):
        build_rewards({"vlm": 1.0}, default)


def test_chat_url_forms():
    assert chat_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_url("http://h:8000/") == "http://h:8000/v1/chat/completions"
    assert chat_url("http://h:8000/v1") == "http://h:8000/v1/chat/completions"
    assert chat_url("https://h/judge/v1/") == "https://h/judge/v1/chat/completions"
    assert chat_url("http://h/v1/chat/completions") == "http://h/v1/chat/completions"


def test_requests_in_flight_stay_within_concurrency(server):
    url, behaviour = server
    behaviour.delay_s = 0.4
    prompts = [f"p{i}" for i in range(6)]
    start = time.monotonic()
    judge(url, concurrency=3).score(batch(prompts))
    assert behaviour.most_in_flight == 3
    assert time.monotonic() - start < 6 * 0.4  # overlapped: about 2 x 0.4 s
    behaviour.most_in_flight = 0
    judge(url, concurrency=1).score(batch(prompts[:2]))
    assert behaviour.most_in_flight == 1


# --- broken servers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ({"id": "x", "choices": []}, "expected a chat completion"),
        ("<html>Bad Gateway</html>", "the reply is not JSON"),
        ({"choices": [{"message": "7"}]}, "expected a chat completion"),
        (completion("Yes", [{"token": "Yes"}]), '"logprobs.content" is not a list'),
    ],
)
def test_a_reply_that_is_no_chat_completion_stops_scoring(server, reply, message):
    url, behaviour = server
    behaviour.script = [reply]
    with pytest.raises(FlowGrpoError, match=re.escape(message)) as caught:
        judge(url, parse="yes_no").score(batch(["a"]))
    assert f"vlm reward {url}/v1/chat/completions (image 0, sample s0)" in str(caught.value)
    assert len(behaviour.requests) == 1  # not retried


def test_http_500_is_retried_then_the_score_comes(server):
    url, behaviour = server
    behaviour.script = [500, 503, completion("9")]
    assert judge(url).score(batch(["a"])).scores[0].value == pytest.approx(0.9)
    assert len(behaviour.requests) == 3


def test_http_400_is_not_retried(server):
    url, behaviour = server
    behaviour.script = [400]
    with pytest.raises(FlowGrpoError, match=r"HTTP 400 .*boom 400"):
        judge(url).score(batch(["a"]))
    assert len(behaviour.requests) == 1


def test_a_slow_server_stops_at_the_batch_deadline(server):
    url, behaviour = server
    behaviour.delay_s = 1.5
    start = time.monotonic()
    with pytest.raises(FlowGrpoError, match=r"deadline_s = 0.3\)") as caught:
        judge(url, deadline_s=0.3, timeout_s=5.0).score(batch(["a", "b"]))
    assert "[reward.vlm]" in str(caught.value)
    assert time.monotonic() - start < 1.5  # gave up before the server answered


def test_a_reply_over_the_size_cap_is_refused(server):
    url, behaviour = server
    behaviour.script = [completion("7" + " " * 2_000_000)]
    with pytest.raises(FlowGrpoError, match=r"too large .*\[reward.vlm\] max_reply_mb = 1"):
        judge(url, max_reply_mb=1).score(batch(["a"]))


# --- the weighted total, the config, the command line ---------------------------------------


def test_a_failed_image_has_no_total_and_says_why(server):
    url, behaviour = server
    behaviour.answer = by_prompt({"cat": completion("6"), "dog": completion("no idea")})
    settings = RewardSection(vlm=VlmRewardSection(url=url, model="judge"))
    with build_rewards({"vlm": 2.0}, settings) as rewards:
        result = rewards.score(batch(["cat", "dog"]))
    assert result.reward == [pytest.approx(1.2), None]  # 2.0 x 6 / 10
    assert result.reward_error == [None, "vlm: no number in the reply 'no idea'"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("template", '"Is it {promt}?"', "uses {promt}: a template knows {prompt} and"),
        ("template", '"Is it {prompt?"', "is not a template"),
        ("template", '"Rate {0}"', "uses {0}"),
        ("api_key_env", '"sk-abc-123"', "= (value not shown) must name, in upper case, an"),
        ("api_key_env", '"abcDEF123"', "= (value not shown) must name, in upper case, an"),
        ("score_range", "[5, 1]", "must be [min, max] with min < max"),
        ("score_range", "[1]", "must be [min, max] with min < max"),
        ("top_logprobs", "0", "must be >= 1"),
        ("parse", '"json"', "is not one of 'number', 'yes_no'"),
        ("url", '"judge:8000"', "expected an http:// or https:// URL"),
        ("concurrency", "0", "must be >= 1"),
    ],
)
def test_bad_settings_name_the_key(tmp_path, key, value, message):
    config = tmp_path / "run.toml"
    config.write_text(f"[reward.weights]\nvlm = 1.0\n\n[reward.vlm]\n{key} = {value}\n")
    with pytest.raises(FlowGrpoError, match=re.escape(message)) as caught:
        load_config(config)
    assert f"{config}:5: `reward.vlm.{key}`" in str(caught.value)
    if key == "api_key_env":  # a pasted key is not printed back
        assert value.strip('"') not in str(caught.value)


def test_missing_server_model_or_key_are_clear_errors(monkeypatch):
    with pytest.raises(FlowGrpoError, match=r"set \[reward.vlm\] url = .* and model"):
        build_rewards({"vlm": 1.0})
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    settings = RewardSection(
        vlm=VlmRewardSection(url="http://x:1", model="m", api_key_env="NO_SUCH_KEY_VAR")
    )
    with pytest.raises(FlowGrpoError, match="'NO_SUCH_KEY_VAR': that environment variable"):
        build_rewards({"vlm": 1.0}, settings)


def test_the_vlm_table_leaves_the_hash_of_runs_without_it_alone():
    from flowgrpo_cli.store.config import config_hash

    plain = load_config(None)
    changed = load_config(None, ["reward.vlm.model=other", "reward.vlm.max_tokens=3"])
    assert config_hash(plain) == config_hash(changed)
    weighted = ["reward.weights={vlm = 1.0}"]
    off = load_config(None, [*weighted, "reward.vlm.with_source_image=false"])
    assert config_hash(load_config(None, weighted)) == config_hash(off)  # runs before the key
    weighted = ["reward.weights={vlm = 1.0}"]
    assert config_hash(load_config(None, weighted)) != config_hash(
        load_config(None, [*weighted, "reward.vlm.max_tokens=3"])
    )


def test_the_reward_command_scores_with_the_judge(server, tmp_path, monkeypatch):
    url, behaviour = server
    behaviour.answer = lambda request: completion("8")
    monkeypatch.chdir(tmp_path)
    image(0).save("a.png")
    result = CliRunner().invoke(
        app, ["reward", "--reward", "vlm", "--set", f"reward.vlm.url={url}",
              "--set", "reward.vlm.model=judge", "--prompt", "a cat", "a.png"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "a.png" in line)
    assert "0.8000" in row and "'8'" in row  # the score and what the judge replied
    assert text_of(behaviour.requests[0]).endswith("Description: a cat")


def test_serve_reward_serves_the_judge(server):
    """`flowgrpo serve-reward --reward vlm`: the `remote` reward gets the judge's scores."""
    pytest.importorskip("uvicorn")
    url, behaviour = server
    behaviour.answer = by_prompt({"cat": completion("3"), "dog": completion("no idea")})
    serve = ("--reward", "vlm", "--set", f"reward.vlm.url={url}", "--set", "reward.vlm.model=judge")
    with serving_reward(*serve, announces="serving vlm") as served:
        settings = RewardSection(remote=RemoteRewardSection(url=served))
        with build_rewards({"remote": 1.0}, settings) as rewards:
            result = rewards.score(batch(["cat", "dog"]))
    assert result.reward == [pytest.approx(0.3), None]
    assert result.reward_error[1] == "remote: server: vlm: no number in the reply 'no idea'"
    assert sorted(text_of(request)[-3:] for request in behaviour.requests) == ["cat", "dog"]


def test_the_docs_examples_load(tmp_path, monkeypatch):
    """docs/rewards.md's [reward.vlm] examples are valid configs that build the judge."""
    page = (Path(__file__).parents[1] / "docs" / "rewards.md").read_text()
    examples = [b for b in re.findall(r"```toml\n(.*?)```", page, re.S) if "[reward.vlm]" in b]
    assert len(examples) == 3
    for number, example in enumerate(examples):
        config = tmp_path / f"example{number}.toml"
        config.write_text(example)
        options = load_config(config).reward.vlm
        monkeypatch.setenv(options.api_key_env, "key")
        assert build_vlm(load_config(config).reward).needs >= {"images", "prompts"}
