"""The ``mock`` adapter: the embedded default model, a small rule engine.

Rules (TOML, ``[[adapters.NAME.rules]]``) pair a regular expression searched in
the last user or tool message with a templated reply; the first match wins,
else the default reply. ``{name}`` in a reply is a named group of the pattern
or a session variable, ``{name|fallback}`` gives the text to use when neither
is known. One rule is fixed and comes first: a last user message starting with
``echo:`` is streamed back verbatim (the text after the prefix), the way to try
policies by hand.

It also plays the parts a chain asks of models (``chains/``), deterministically:
a classify prompt (a system message with a ``Labels:`` line) is answered with the
listed label the last user message names, else ``unknown`` (``util/intents.py``);
speech to text (:meth:`MockAdapter.transcribe_once`) hears a WAV's comment
(``util/wav.py``). aiserve-sim answers both the same way.

A rule may also give ``reasoning`` (streamed as ``reasoning_content`` before the
reply) and a ``tool_call`` (a function name and templated JSON arguments): when
the request offers a tool of that name and ``tool_choice`` is not ``"none"``,
the reply is that tool call, streamed in fragments, with ``finish_reason:
"tool_calls"``. A request whose ``tool_choice`` requires a tool no rule names
gets a call of it with ``{}``. The mock carries nothing it cannot act on
(:attr:`MockAdapter.capabilities`): images, ``response_format``, ``logprobs``...
are refused with a 400 naming the field.

Replies stream as word-sized deltas after ``ttft_ms``, one every
``inter_token_ms``. Token counts in ``usage`` are word-piece counts (words and
punctuation marks), not a model tokenizer's.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
import trio

from ..core.errors import BadRequest
from ..observability.events import NULL_HOOK, UpstreamHook
from ..util.intents import simulated_label
from ..util.vectors import DEFAULT_DIMENSIONS, embedding_inputs, embeddings_body, heavy
from ..util.wav import WavError, transcript
from .base import (
    Adapter,
    Capabilities,
    Delta,
    DeltaSink,
    EmbeddingRequest,
    InferenceRequest,
    Message,
    ToolCallDelta,
    TranscriptionRequest,
    Usage,
)
from .retry import Progress
from .settings import MockAdapterConfig, MockToolCall

ECHO_PREFIX = "echo:"
_WORDS_RE = re.compile(r"\s*\S+|\s+$")
_PIECES_RE = re.compile(r"\w+|[^\w\s]")
#: Tool-call arguments go out in fragments of a few characters, as models send them.
_ARG_PIECES = re.compile(r".{1,12}", re.DOTALL)
_TEMPLATE_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\|([^{}]*))?\}")


def count_tokens(text: str) -> int:
    """An approximate token count: words and punctuation marks."""
    return len(_PIECES_RE.findall(text))


def split_words(text: str) -> list[str]:
    """Word-sized pieces that concatenate back to ``text`` exactly."""
    return _WORDS_RE.findall(text)


def fill_template(template: str, values: dict[str, str]) -> str:
    """Replace ``{name}`` / ``{name|fallback}`` from ``values``; unknown names keep their text."""

    def sub(m: re.Match[str]) -> str:
        name, fallback = m.group(1), m.group(2)
        if name in values:
            return values[name]
        return fallback if fallback is not None else m.group(0)

    return _TEMPLATE_RE.sub(sub, template)


@dataclass(frozen=True, slots=True)
class _Rule:
    pattern: re.Pattern[str]
    reply: str
    reasoning: str
    tool: MockToolCall | None


@dataclass(frozen=True, slots=True)
class Reply:
    """What the mock answers: text, reasoning before it, or a tool call."""

    text: str
    reasoning: str = ""
    tool_name: str | None = None
    arguments: str = ""


class RuleEngine:
    """Pure reply selection: last user message + variables -> reply text."""

    def __init__(self, config: MockAdapterConfig) -> None:
        flags = re.IGNORECASE | re.DOTALL
        self._rules = [
            _Rule(re.compile(r.pattern, flags), r.reply, r.reasoning, r.tool_call)
            for r in config.rules
        ]
        self._default = config.default_reply

    def reply(
        self,
        messages: list[Message],
        variables: dict[str, str],
        tools: list[str] | None = None,
        tool_choice: str | None = None,
    ) -> Reply:
        """The answer to ``messages``; a tool call only if ``tools`` offers it.

        Args:
            tools: the function names the request offers.
            tool_choice: ``none``, ``auto``, ``required``, or a function's name.
        """
        last = next((m for m in reversed(messages) if m.role in ("user", "tool")), None)
        text = last.text() if last is not None else ""
        offered = [] if tool_choice == "none" else list(tools or ())
        if tool_choice not in (None, "none", "auto", "required"):
            offered = [t for t in offered if t == tool_choice]
        if last is not None and last.role == "user" and text.startswith(ECHO_PREFIX):
            return Reply(text[len(ECHO_PREFIX) :].lstrip(" "))
        system = "\n".join(m.text() for m in messages if m.role in ("system", "developer"))
        label = simulated_label(system, text) if system else None
        if label is not None:
            return Reply(label)
        for rule in self._rules:
            m = rule.pattern.search(text)
            if not m:
                continue
            values = dict(variables)
            values.update({k: v for k, v in m.groupdict().items() if v is not None})
            reasoning = fill_template(rule.reasoning, values) if rule.reasoning else ""
            if rule.tool is not None and rule.tool.name in offered:
                quoted = {k: json.dumps(v)[1:-1] for k, v in values.items()}
                args = fill_template(rule.tool.arguments, quoted)
                return Reply("", reasoning, rule.tool.name, args)
            return Reply(fill_template(rule.reply, values), reasoning)
        if offered and tool_choice != "auto" and tool_choice is not None:
            return Reply("", "", offered[0], "{}")  # a tool is required; no rule names one
        return Reply(fill_template(self._default, dict(variables)))


class MockAdapter(Adapter):
    """Streams the rule engine's reply with configurable pacing."""

    capabilities = Capabilities(
        fields=frozenset(
            {"temperature", "top_p", "stop", "seed", "tools", "tool_choice", "reasoning_effort"}
        ),
        parts=frozenset({"text"}),
        embeddings=True,
        transcription=True,
    )

    def __init__(
        self, name: str, config: MockAdapterConfig, *, hook: UpstreamHook = NULL_HOOK
    ) -> None:
        """Build the adapter (no retries: there is nothing to recover from).

        Args:
            name: the ``[adapters.NAME]`` key.
            config: its rules and pacing.
            hook: told of each try and of an error that ends a call.
        """
        super().__init__(name, config.models, hook=hook)
        self.config = config
        self.engine = RuleEngine(config)

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        """Send the rule engine's reply piece by piece, after ``ttft_ms``."""
        reply = self.engine.reply(
            request.messages, request.variables, request.tool_names, request.tool_choice
        )
        pieces = [Delta(reasoning=w) for w in split_words(reply.reasoning)]
        finish = "stop"
        if reply.tool_name is not None:
            call = "call_" + hashlib.sha1(request.request_id.encode()).hexdigest()[:24]
            first = ToolCallDelta(index=0, id=call, type="function", name=reply.tool_name)
            pieces.append(Delta(tool_calls=[first]))
            pieces += [
                Delta(tool_calls=[ToolCallDelta(index=0, arguments=a)])
                for a in _ARG_PIECES.findall(reply.arguments)
            ]
            finish = "tool_calls"
        else:
            words = split_words(reply.text)
            if request.max_tokens is not None and len(words) > request.max_tokens:
                words, finish = words[: request.max_tokens], "length"
            pieces += [Delta(text=w) for w in words]
        prompt_tokens = sum(count_tokens(m.text()) for m in request.messages)
        ttft = self.config.ttft_ms / 1000.0
        gap = self.config.inter_token_ms / 1000.0
        if ttft:
            await trio.sleep(ttft)
        for i, piece in enumerate(pieces):
            if i and gap:
                await trio.sleep(gap)
            await send.send(piece)
        produced = "".join(p.text or p.reasoning or _args(p) for p in pieces)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=count_tokens(produced))
        await send.send(Delta(finish_reason=finish, usage=usage))

    async def transcribe_once(self, request: TranscriptionRequest) -> str:
        """A WAV's comment, or a sentence naming its length (``util/wav.py``), after ``ttft_ms``.

        Raises:
            BadRequest: ``format`` is ``wav`` and the audio is not a WAV file.
        """
        try:
            text = transcript(request.audio, request.format)
        except WavError as exc:
            why = f"the audio cannot be transcribed: {exc}"
            raise BadRequest(why, code="invalid_audio") from None
        if self.config.ttft_ms:
            await trio.sleep(self.config.ttft_ms / 1000.0)
        return text

    async def embed_once(self, request: EmbeddingRequest) -> bytes:
        """Lexical unit vectors (``util/vectors.py``): the same text, the same vector; texts
        sharing their words are near.

        Raises:
            BadRequest: ``input``, ``dimensions`` or ``encoding_format`` is not usable.
        """
        try:
            body = _embed_decoder.decode(_embed_encoder.encode(request.body))
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid request: {exc}", code="invalid_type") from None
        try:
            inputs = embedding_inputs(body.input)
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc), param="input", code="invalid_type") from None
        if body.dimensions < 1:
            raise BadRequest("`dimensions` must be at least 1", param="dimensions")
        if body.encoding_format not in ("float", "base64"):
            raise BadRequest(
                "`encoding_format` must be 'float' or 'base64'", param="encoding_format"
            )
        counts = [count_tokens(x) if isinstance(x, str) else len(x) for x in inputs]
        if self.config.ttft_ms:
            await trio.sleep(self.config.ttft_ms / 1000.0)
        make = partial(
            embeddings_body, request.model, inputs, counts, body.dimensions, body.encoding_format
        )
        out = await trio.to_thread.run_sync(make) if heavy(inputs) else make()
        return _embed_encoder.encode(out)


class _EmbeddingsBody(msgspec.Struct):
    input: Any
    dimensions: int = DEFAULT_DIMENSIONS
    encoding_format: str = "float"


_embed_decoder = msgspec.json.Decoder(_EmbeddingsBody)
_embed_encoder = msgspec.json.Encoder()


def _args(d: Delta) -> str:
    return "".join(c.arguments for c in d.tool_calls or ())
