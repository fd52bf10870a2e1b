"""Token budget control: count prompt tokens with a real tokenizer, trim old history.

The counting follows OpenAI's published chat accounting (a few tokens of framing
per message plus the encoded role, name and content, and three tokens priming
the reply). The tokenizer is chosen by model family: ``o200k_base`` for the
GPT-4o / 4.1 / 5 and o-series families, ``cl100k_base`` for everything else
(GPT-4, GPT-3.5 and the many OpenAI-compatible open models, for which it is a
close stand-in). The tables ship inside ``bpe-openai``, so nothing is fetched.

A loaded table costs a worker 75-95 MB and 0.15-0.4 s, so it is loaded only
when a prompt might not fit, in a thread (the event loop never stalls on it).
Most prompts never need it: every token of these byte-level encodings stands
for at least one byte of UTF-8, so a prompt whose bytes (plus framing) fit the
window fits in tokens too, and nothing can need trimming.

:func:`fit_messages` is pure: it takes a counting function, so tests need no
tokenizer, and it never reorders or edits a message -- it only drops the oldest
turns that are neither system prompts nor the newest message.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import trio

from ..core.errors import BadRequest
from ..core.slices import CHARS_PER_STEP, Steps, finish, run_sliced
from .base import InferenceRequest, Message

#: Framing tokens per message, and for a ``name`` field (OpenAI's chat accounting).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
#: Tokens priming the assistant's reply (``<|start|>assistant<|message|>``).
REPLY_PRIMING = 3
#: What one non-text content part counts for (a 1024x1024 image at high detail).
PART_TOKENS = 765
_SYSTEM_ROLES = frozenset({"system", "developer"})
#: Characters tokenized per step (the tables encode ~10 MB/s at worst).
TOKENIZE_STEP = CHARS_PER_STEP * 16
_O200K_PREFIXES = ("gpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "chatgpt-4o", "o1", "o3", "o4")


class Encoding(Protocol):
    """What we need of a tokenizer (``bpe_openai.Encoding`` and tiktoken's both fit)."""

    def encode_ordinary(self, text: str) -> list[int]: ...


def encoding_name_for(model: str, override: str | None = None) -> str:
    """The tokenizer table for ``model``: ``override`` if given, else by model family."""
    if override:
        return override
    name = model.lower().rsplit("/", 1)[-1]
    return "o200k_base" if name.startswith(_O200K_PREFIXES) else "cl100k_base"


@functools.cache
def get_encoding(name: str) -> Encoding:
    """The named tokenizer, loaded once per process (loading takes 0.1-0.4 s).

    Raises:
        ValueError: ``name`` is not a table ``bpe-openai`` ships.
    """
    with warnings.catch_warnings():
        # bpe-openai 0.1.4 reads its tables with the deprecated
        # importlib.resources.open_binary; that is its business, not an error of ours.
        warnings.simplefilter("ignore", DeprecationWarning)
        import bpe_openai  # type: ignore[import-untyped]  # ships no py.typed

        try:
            enc: Encoding = bpe_openai.get_encoding(name)
        except (KeyError, ValueError, bpe_openai.TokenizerError) as exc:
            known = ", ".join(bpe_openai.list_encoding_names())
            raise ValueError(f"unknown tokenizer {name!r} (known: {known})") from exc
    return enc


_loaded: dict[str, Encoding] = {}
_loading = trio.Lock()


async def load_encoding(name: str) -> Encoding:
    """:func:`get_encoding` without stalling the event loop: the first load runs in a thread."""
    enc = _loaded.get(name)
    if enc is None:
        async with _loading:  # one load at a time: two would hold the table twice
            enc = _loaded.get(name)
            if enc is None:
                enc = _loaded[name] = await trio.to_thread.run_sync(get_encoding, name)
    return enc


def _message_cost(m: Message, length: Callable[[str], int]) -> int:
    """OpenAI's chat accounting for one message, each text measured by ``length``.

    A part that is not text (an image, audio, a file) counts as
    :data:`PART_TOKENS`: its cost depends on the model, not on its bytes.
    """
    n = TOKENS_PER_MESSAGE + length(m.role) + length(m.text())
    if m.name:
        n += TOKENS_PER_NAME + length(m.name)
    for call in m.tool_calls or ():
        n += length(call.function.name) + length(call.function.arguments)
    if isinstance(m.content, list):
        n += PART_TOKENS * sum(1 for p in m.content if p.type != "text")
    return n


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def message_bound(m: Message) -> int:
    """An upper bound of a message's token cost without a tokenizer: its UTF-8 bytes."""
    return _message_cost(m, _utf8_len)


def _cut(text: str, lo: int, hi: int) -> int:
    """Where to end the slice ``text[lo:hi]``: before a space that follows a non-space.

    The tables' pre-tokenizer never joins across such a point, so counting the
    slices one by one gives the whole text's count.
    """
    if hi >= len(text):
        return len(text)
    at = text.rfind(" ", max(lo + 1, hi - 256), hi)
    while at > lo and text[at - 1].isspace():
        at = text.rfind(" ", max(lo + 1, hi - 256), at)
    return at if at > lo else hi


def text_tokens_steps(enc: Encoding, text: str, step: int = TOKENIZE_STEP) -> Steps[int]:
    """The tokens of ``text`` under ``enc``, counted in slices of ``step`` characters.

    Raises:
        BadRequest: ``context_length_exceeded`` -- the tokenizer refused the text
            (its own limits on one piece).
    """
    total = 0
    lo = 0
    while lo < len(text):
        hi = _cut(text, lo, lo + step)
        try:
            total += len(enc.encode_ordinary(text[lo:hi]))
        except Exception as exc:  # the tables' TokenLimitError and ValueError
            raise BadRequest(
                f"the prompt cannot be tokenized: {exc}",
                param="messages",
                code="context_length_exceeded",
            ) from None
        lo = hi
        if lo < len(text):
            yield
    return total


def message_tokens_steps(enc: Encoding, m: Message) -> Steps[int]:
    """One message's token cost under ``enc``, in steps (see :func:`_message_cost`)."""
    texts: list[str] = []

    def later(text: str) -> int:  # the framing now, the texts' tokens in steps
        texts.append(text)
        return 0

    n = _message_cost(m, later)
    for t in texts:
        n += yield from text_tokens_steps(enc, t)
    return n


def message_counter(enc: Encoding) -> Callable[[Message], int]:
    """A function giving one message's token cost under ``enc``."""
    return lambda m: finish(message_tokens_steps(enc, m))


async def _costs(enc: Encoding, messages: Sequence[Message]) -> dict[int, int]:
    """Each message's cost by ``id``, counted on the event loop in slices."""
    return {id(m): await run_sliced(message_tokens_steps(enc, m)) for m in messages}


@dataclass(frozen=True, slots=True)
class Fitted:
    """The messages to send, how many were dropped, and the prompt's token count.

    ``prompt_tokens`` is None when the prompt was shown to fit without counting.
    """

    messages: list[Message]
    trimmed: int
    prompt_tokens: int | None


def fit_messages(
    messages: Sequence[Message],
    *,
    max_tokens: int | None,
    context_window: int,
    count: Callable[[Message], int],
) -> Fitted:
    """Drop the oldest non-system messages until prompt + ``max_tokens`` fits the window.

    System and developer messages and the newest message are always kept; the
    others go oldest first. With no ``max_tokens`` the reply needs room for at
    least one token.

    Raises:
        BadRequest: ``context_length_exceeded`` -- even the messages that must be
            kept do not fit.
    """
    reply = max_tokens if max_tokens is not None else 1
    costs = [count(m) for m in messages]
    total = REPLY_PRIMING + sum(costs)
    limit = context_window - reply
    last = len(messages) - 1
    dropped: set[int] = set()
    for i, m in enumerate(messages):
        if total <= limit:
            break
        if i == last or m.role in _SYSTEM_ROLES:
            continue
        dropped.add(i)
        total -= costs[i]
    if total > limit:
        raise BadRequest(
            f"the prompt needs {total} tokens and the reply {reply}, more than the "
            f"model's context window of {context_window} tokens",
            param="messages",
            code="context_length_exceeded",
        )
    kept = [m for i, m in enumerate(messages) if i not in dropped]
    return Fitted(messages=kept, trimmed=len(dropped), prompt_tokens=total)


async def fit_request(
    request: InferenceRequest, context_window: int, tokenizer: str | None
) -> InferenceRequest:
    """``request`` fitted to the window by :func:`fit_messages`, with the model family's tokenizer.

    A prompt whose UTF-8 size already fits is returned as it is, uncounted;
    only one that might not fit is counted (and the table loaded, once), and
    comes back as a new request with the kept ``messages``, the number
    dropped in ``trimmed`` (the response reports it in
    ``X-Aiserve-Trimmed-Messages``) and the count in ``prompt_tokens``.
    ``request`` itself is never changed.

    Raises:
        BadRequest: ``context_length_exceeded``.
    """
    reply = request.max_tokens if request.max_tokens is not None else 1
    bound = REPLY_PRIMING + sum(message_bound(m) for m in request.messages)
    if bound <= context_window - reply:
        return request
    enc = await load_encoding(encoding_name_for(request.model, tokenizer))
    costs = await _costs(enc, request.messages)
    fitted = fit_messages(
        request.messages,
        max_tokens=request.max_tokens,
        context_window=context_window,
        count=lambda m: costs[id(m)],
    )
    return msgspec.structs.replace(
        request,
        messages=fitted.messages,
        trimmed=fitted.trimmed,
        prompt_tokens=fitted.prompt_tokens,
    )


async def count_prompt(messages: Sequence[Message], model: str, tokenizer: str | None) -> int:
    """The exact prompt tokens of ``messages`` (for an upstream that reports no usage)."""
    costs = await _costs(await load_encoding(encoding_name_for(model, tokenizer)), messages)
    return REPLY_PRIMING + sum(costs.values())
