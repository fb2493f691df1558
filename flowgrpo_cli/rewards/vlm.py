"""`vlm`: a vision-language model judges each image, through any OpenAI-compatible
chat-completions server (vLLM or sglang serving Qwen2.5-VL, UnifiedReward, ...).

One request per image, `concurrency` of them in flight (the server batches what arrives
together), all of a batch's requests, retries and backoff included, within `deadline_s`
(transport.py). Each request is one user message: the image as a base64 PNG data URL in an
`image_url` part, then the `template` with {prompt} and {ground_truth} filled in:

    {"model": "...", "max_tokens": 512, "temperature": 0.0,
     "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
         {"type": "text", "text": "<the template, filled>"}]}],
     "logprobs": true, "top_logprobs": 20}          # parse = "yes_no" only

With `with_source_image` (an editing data set), the image's source image goes first, in an
`image_url` part of its own, and the result second, before the text: the template says which
is which ("the first image is the original, the second the edited result").

The score is read from `choices[0]`:

- parse = "number": the first number of the reply (or the first after the last occurrence of
  `number_after`), which must lie in score_range [lo, hi], mapped to (n - lo) / (hi - lo);
- parse = "yes_no": the answer token is the first token of the reply that reads "yes" or "no"
  (any case, white space and punctuation around it ignored); P(yes) = the summed probability
  of its "yes" variants among that token's top log-probabilities, over that of its "yes" and
  "no" variants. A reply without log-probabilities stops scoring (the server does not give
  them), unless `text_fallback` scores the reply's first yes / no word as 1 / 0.

A reply the rule cannot read (no number, a number out of range, no yes / no) fails that image
only, with the reply in the message. A reply that is not a chat completion (not JSON, no
choices) and the HTTP failures of transport.py stop scoring with an error naming the server:
the server is broken, not the image.
"""

from __future__ import annotations

import json
import math
import os
import re
import string
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from PIL import Image

from flowgrpo_cli import untrusted
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import ImageScore, Need, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.remote import encode_png
from flowgrpo_cli.rewards.transport import JsonPoster, excerpt
from flowgrpo_cli.store.config import (
    VLM_TEMPLATE,
    RewardSection,
    VlmRewardSection,
    template_fields,
)

_REPLY_DEPTH = 16  # choices[0].logprobs.content[i].top_logprobs[j].bytes nests 7 deep
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO_WORD = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def chat_url(url: str) -> str:
    """The chat-completions endpoint of `url`: a path ending in /chat/completions is used as
    it is; a path ending in /v1 (an OpenAI client's base URL) gets /chat/completions; any
    other (the server's root) gets /v1/chat/completions."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith("/chat/completions"):
        return url
    path += "/chat/completions" if path.endswith("/v1") else "/v1/chat/completions"
    return urllib.parse.urlunsplit(parts._replace(path=path))


@dataclass(frozen=True)
class Reply:
    """What the judge said: `choices[0]` of a chat completion."""

    text: str
    finish_reason: str | None
    tokens: list[dict[str, Any]] | None  # logprobs.content; None when the reply has none


def read_reply(raw: bytes, where: str) -> Reply:
    """The first choice of a chat completion; FlowGrpoError unless the reply is one."""
    try:
        reply = untrusted.loads(raw, max_depth=_REPLY_DEPTH)
    except untrusted.BadJSON as err:
        what = "is not JSON" if err.column is not None else "is refused"
        raise FlowGrpoError(f"{where}: the reply {what} ({err}): {excerpt(raw)}") from None
    choices = reply.get("choices") if isinstance(reply, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    text = message.get("content") if isinstance(message, dict) else None
    if (
        not isinstance(choice, dict)
        or not isinstance(message, dict)
        or not isinstance(text, str | None)
    ):
        raise FlowGrpoError(
            f'{where}: expected a chat completion {{"choices": [{{"message": {{"content": '
            f"...}}}}]}}, got {excerpt(raw)}"
        )
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
    if tokens is not None and not (
        isinstance(tokens, list) and all(_is_token(token) for token in tokens)
    ):
        raise FlowGrpoError(
            f'{where}: "logprobs.content" is not a list of {{"token", "logprob", '
            f'"top_logprobs"}}: {excerpt(raw)}'
        )
    finish = choice.get("finish_reason")
    return Reply(text or "", finish if isinstance(finish, str) else None, tokens or None)


def _is_token(entry: object) -> bool:
    def scored(item: object) -> bool:
        return (
            isinstance(item, dict)
            and isinstance(item.get("token"), str)
            and isinstance(item.get("logprob"), int | float)
            and not isinstance(item.get("logprob"), bool)
        )

    top = entry.get("top_logprobs", []) if isinstance(entry, dict) else None
    return scored(entry) and isinstance(top, list) and all(scored(item) for item in top)


def _quoted(text: str) -> str:
    return excerpt(text.encode("utf-8"))


def number_score(reply: Reply, options: VlmRewardSection) -> ImageScore:
    """parse = "number": the reply's number, mapped from score_range to [0, 1]."""
    text, start = reply.text, 0
    if options.number_after:
        marks = list(re.finditer(re.escape(options.number_after), text, re.IGNORECASE))
        if not marks:
            return ImageScore.failed(
                f"no {options.number_after!r} (reward.vlm.number_after) in the reply "
                f"{_quoted(text)}{_cut_off(reply)}"
            )
        start = marks[-1].end()
    found = _NUMBER.search(text, start)
    if found is None:
        return ImageScore.failed(f"no number in the reply {_quoted(text)}{_cut_off(reply)}")
    value = float(found.group())
    low, high = options.score_range
    if not low <= value <= high:
        return ImageScore.failed(
            f"{found.group()} in the reply {_quoted(text)} is outside reward.vlm.score_range "
            f"[{low:g}, {high:g}]"
        )
    return ImageScore(value=(value - low) / (high - low))


def _cut_off(reply: Reply) -> str:
    if reply.finish_reason == "length":
        return " (cut off at reward.vlm.max_tokens: raise it)"
    return ""


def _answer(token: str) -> str | None:
    """What the token reads, if it reads yes or no (in any case, with white space and
    punctuation around it ignored); else None."""
    word = token.strip().strip(string.punctuation).strip().lower()
    return word if word in ("yes", "no") else None


def yes_probability(tokens: list[dict[str, Any]]) -> float | None:
    """P(yes) at the first token that reads yes or no: its top log-probabilities' yes
    variants over its yes and no variants (None when no token reads yes or no)."""
    for entry in tokens:
        if _answer(entry["token"]) is None:
            continue
        candidates = {item["token"]: float(item["logprob"]) for item in entry["top_logprobs"]}
        candidates.setdefault(entry["token"], float(entry["logprob"]))
        answers = [(_answer(token), logprob) for token, logprob in candidates.items()]
        answers = [(word, logprob) for word, logprob in answers if word is not None]
        # In log space from the largest, so that tiny probabilities do not all round to 0.
        top = max(logprob for _, logprob in answers)
        yes = sum(math.exp(logprob - top) for word, logprob in answers if word == "yes")
        no = sum(math.exp(logprob - top) for word, logprob in answers if word == "no")
        return yes / (yes + no)
    return None


def yes_no_score(reply: Reply, options: VlmRewardSection, where: str) -> ImageScore:
    """parse = "yes_no": P(yes) from the log-probabilities, or (text_fallback) 1 / 0."""
    if reply.tokens is None:
        if not options.text_fallback:
            raise FlowGrpoError(
                f"{where}: the reply has no log-probabilities (asked for with logprobs = true, "
                f"top_logprobs = {options.top_logprobs}); serve them (vLLM: --max-logprobs), "
                "or set [reward.vlm] text_fallback = true to score the reply's yes / no as 1 / 0"
            )
        word = _YES_NO_WORD.search(reply.text)
        if word is None:
            return ImageScore.failed(f"no yes or no in the reply {_quoted(reply.text)}")
        return ImageScore(value=1.0 if word.group().lower() == "yes" else 0.0)
    probability = yes_probability(reply.tokens)
    if probability is None:
        return ImageScore.failed(
            f"no token of the reply {_quoted(reply.text)} reads yes or no{_cut_off(reply)}"
        )
    return ImageScore(value=probability)


class VlmReward:
    name = "vlm"
    needs: frozenset[Need] = frozenset({"images", "prompts"})  # + ground_truths, if asked
    parallel_safe = True  # waits on the network while the other rewards compute

    def __init__(self, options: VlmRewardSection, api_key: str = "") -> None:
        self.options = options
        self.url = chat_url(options.url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._poster = JsonPoster(self.url, options, headers)
        self._uses_target = "ground_truth" in template_fields(options.template)
        # A template's {ground_truth} is a need of the batch's column only: a prompt without a
        # target fails its image (below), so prepare does not refuse it.
        target: frozenset[Need] = frozenset({"ground_truths"} if self._uses_target else ())
        self.needs = _needs(options) | target

    @classmethod
    def configured_needs(cls, section: RewardSection) -> frozenset[Need]:
        """What prepare asks of the data under [reward] `section`: source images, with
        `with_source_image`."""
        return _needs(section.vlm)

    def score(self, batch: RewardBatch) -> RewardOutput:
        """One request per image, `concurrency` in flight, all done by `deadline_s` from now;
        details["reply"] holds what the judge said (None where nothing was asked)."""
        deadline = time.monotonic() + self.options.deadline_s
        workers = min(self.options.concurrency, len(batch)) or 1
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vlm") as pool:
            futures = [pool.submit(self._judge, batch, i, deadline) for i in range(len(batch))]
            try:
                for future in as_completed(futures):
                    future.result()  # the first error stops the batch
            except BaseException:
                for future in futures:  # those not started yet; the others end by deadline
                    future.cancel()
                raise
        judged = [future.result() for future in futures]
        return RewardOutput(
            scores=[score for score, _ in judged], details={"reply": [text for _, text in judged]}
        )

    def _judge(
        self, batch: RewardBatch, index: int, deadline: float
    ) -> tuple[ImageScore, str | None]:
        prompt = batch.prompts[index] if batch.prompts is not None else ""
        target = batch.ground_truths[index] if batch.ground_truths is not None else None
        if self._uses_target and target is None:
            return ImageScore.failed(
                "no target text for this image, and reward.vlm.template asks for {ground_truth}"
            ), None
        sample = (batch.metadata or [{}] * len(batch))[index].get("sample_id")
        named = f", sample {sample}" if sample is not None else ""
        where = f"vlm reward {self.url} (image {index}{named})"
        sources = batch.source_images if self.options.with_source_image else None
        source = sources[index] if sources is not None else None  # RewardSet checks `needs`
        body = self._request(batch.images[index], prompt, target or "", source)
        reply = read_reply(self._poster.post(body, where, deadline), where)
        if self.options.parse == "number":
            return number_score(reply, self.options), reply.text
        return yes_no_score(reply, self.options, where), reply.text

    def _request(
        self, image: Image.Image, prompt: str, target: str, source: Image.Image | None = None
    ) -> bytes:
        """The chat request for one image: [its source image, if given,] the image, then the
        filled template."""
        options = self.options
        question = options.template.format(prompt=prompt, ground_truth=target)
        pictures = [source, image] if source is not None else [image]
        content: list[dict[str, Any]] = [
            {"type": "image_url",
             "image_url": {"url": f"data:image/png;base64,{encode_png(picture)}"}}
            for picture in pictures
        ]  # fmt: skip
        payload: dict[str, Any] = {
            "model": options.model,
            "messages": [{"role": "user", "content": [
                *content, {"type": "text", "text": question}
            ]}],
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
        }  # fmt: skip
        if options.parse == "yes_no":
            payload |= {"logprobs": True, "top_logprobs": options.top_logprobs}
        return json.dumps(payload).encode("utf-8")

    @property
    def info(self) -> dict[str, str]:
        return {"url": self.url, "model": self.options.model, "parse": self.options.parse}

    def close(self) -> None:
        """Nothing to release: each request opens and closes its own connection."""


def _needs(options: VlmRewardSection) -> frozenset[Need]:
    source: frozenset[Need] = frozenset({"source_images"} if options.with_source_image else ())
    return VlmReward.needs | source


def build_vlm(section: RewardSection) -> VlmReward:
    options = section.vlm
    if not options.url or not options.model:
        raise FlowGrpoError(
            'reward "vlm" needs a server and a model: set [reward.vlm] url = '
            '"http://host:8000" and model = "the served model name"'
        )
    if options.with_source_image and options.template == VLM_TEMPLATE:
        raise FlowGrpoError(
            "[reward.vlm] with_source_image = true sends two images, the source first and the "
            "result second, but [reward.vlm] template is the default question about one "
            "image: write a template that says which image is which"
        )
    api_key = ""
    if options.api_key_env:
        api_key = os.environ.get(options.api_key_env, "")
        if not api_key:
            raise FlowGrpoError(
                f"[reward.vlm] api_key_env = {options.api_key_env!r}: that environment "
                "variable is not set (or empty); export it with the server's API key"
            )
    return VlmReward(options, api_key)
