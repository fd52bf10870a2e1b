"""State shared by the sim's HTTP and WebSocket sides: counters, the request log, reply set-up."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..adapters.tokens import encoding_name_for, get_encoding
from .model import Fault, Plan, SimSettings, plan_reply
from .prompt_cache import MIN_TOKENS, PromptCache
from .reply import Script, script_for
from .request import IMAGE_TOKENS, ResponseFormat, SimMessage, Tool, ToolChoice, prompt_texts

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: Request keys remembered for ``X-Sim-Fault-Times`` attempt counting.
_MAX_KEYS = 4096
#: Requests kept for ``GET /sim/requests``.
LOG_SIZE = 50


class Asking(Protocol):
    """What a request asks of the sim's decision, whichever API it came in."""

    @property
    def model(self) -> str: ...
    @property
    def messages(self) -> list[SimMessage]: ...
    @property
    def tools(self) -> list[Tool] | None: ...
    @property
    def tool_choice(self) -> ToolChoice: ...
    @property
    def response_format(self) -> ResponseFormat | None: ...
    @property
    def reasoning_effort(self) -> str | None: ...


@dataclass(slots=True)
class Stats:
    """Counters served at ``GET /sim/stats``."""

    requests: int = 0
    completed: int = 0
    #: The client went away (HTTP disconnect, WebSocket closed) mid-reply.
    cancelled: int = 0
    #: The upstream budget (``X-Request-Timeout-Ms`` / ``timeout_ms``) ran out.
    expired: int = 0
    open_streams: int = 0
    ws_connections: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    last_timeout_ms: int | None = None

    def as_dict(self, attempts: dict[str, int]) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "expired": self.expired,
            "open_streams": self.open_streams,
            "ws_connections": self.ws_connections,
            "faults": dict(self.faults),
            "last_timeout_ms": self.last_timeout_ms,
            "attempts": attempts,
        }

    def count_fault(self, fault: Fault) -> None:
        self.faults[fault.kind if fault.kind != "status" else str(fault.status)] += 1


class RequestLog:
    """The last :data:`LOG_SIZE` requests as received, for ``GET /sim/requests``.

    Bodies are kept as the bytes (HTTP) or text (WebSocket) that arrived and
    decoded only when asked for, so recording costs the hot path one append.
    A body that is not UTF-8 shows with U+FFFD in place of the bad bytes.
    """

    __slots__ = ("_items",)

    def __init__(self, size: int = LOG_SIZE) -> None:
        self._items: deque[tuple[str, str, dict[str, str], bytes | str]] = deque(maxlen=size)

    def add(self, path: str, transport: str, headers: dict[str, str], body: bytes | str) -> None:
        self._items.append((path, transport, headers, body))

    def clear(self) -> None:
        self._items.clear()

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": [
                {
                    "path": path,
                    "transport": transport,
                    "headers": headers,
                    "body": body if isinstance(body, str) else body.decode("utf-8", "replace"),
                }
                for path, transport, headers, body in self._items
            ]
        }


def header_dict(scope: Scope) -> dict[str, str]:
    """The request's headers, names lower-cased; repeated ones joined with ``, ``."""
    out: dict[str, str] = {}
    for k, v in scope["headers"]:
        name, value = k.decode("latin-1").lower(), v.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


class Disconnected(Exception):
    """The peer went away while a reply was being generated."""


class Done:
    """Set just before the last byte of a reply is sent (a disconnect after it is normal)."""

    __slots__ = ("cancelled", "flag")

    def __init__(self) -> None:
        self.flag = False
        self.cancelled = False


@dataclass(frozen=True, slots=True)
class Decided:
    """What one chat request's reply says, before its timing is drawn."""

    script: Script
    prompt_tokens: int
    #: The request's number in this process (reply ids derive from it).
    serial: int
    #: Of ``prompt_tokens``: read from the prompt cache, written to it (:mod:`.prompt_cache`).
    cache_read: int = 0
    cache_write: int = 0


@dataclass(frozen=True, slots=True)
class Prepared:
    """One chat request made ready to serve: what it says, and when."""

    script: Script
    plan: Plan
    prompt_tokens: int
    serial: int
    #: Of ``prompt_tokens``: read from the prompt cache, written to it (:mod:`.prompt_cache`).
    cache_read: int = 0
    cache_write: int = 0


class SimCore:
    """Settings, seeded randomness and bookkeeping shared by every transport."""

    def __init__(self, settings: SimSettings | None = None) -> None:
        self.settings = settings or SimSettings()
        self.rng = random.Random(self.settings.seed)
        self.stats = Stats()
        self.log = RequestLog()
        self._attempts: OrderedDict[str, int] = OrderedDict()
        self._serial = 0
        self.prompt_cache = PromptCache()

    def next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def attempt(self, key: str | None) -> int:
        """Count an attempt of request ``key`` (1-based); unkeyed requests are always 1."""
        if not key:
            return 1
        n = self._attempts.pop(key, 0) + 1
        self._attempts[key] = n
        while len(self._attempts) > _MAX_KEYS:
            self._attempts.popitem(last=False)
        return n

    def attempts(self) -> dict[str, int]:
        return dict(self._attempts)

    def text_tokens(self, model: str, text: str) -> int:
        return len(get_encoding(encoding_name_for(model)).encode_ordinary(text))

    def decide_for(self, ask: Asking) -> Decided:
        """:meth:`decide` on what a request (any API's, as the sim reads it) asks."""
        return self.decide(
            ask.model,
            ask.messages,
            tools=ask.tools,
            tool_choice=ask.tool_choice,
            response_format=ask.response_format,
            reasoning_effort=ask.reasoning_effort,
        )

    def decide(
        self,
        model: str,
        messages: list[SimMessage],
        *,
        tools: list[Tool] | None = None,
        tool_choice: ToolChoice = None,
        response_format: ResponseFormat | None = None,
        reasoning_effort: str | None = None,
    ) -> Decided:
        """Decide what the reply says (:func:`~.reply.script_for`) and count the prompt.

        Prompt tokens: 3 per message plus its text (content and tool calls,
        counted with the model's tokenizer), :data:`IMAGE_TOKENS` per image,
        plus 3 for the reply's priming.

        Raises:
            SchemaError: a schema in the request has no instance.
        """
        serial = self.next_serial()
        texts, images = prompt_texts(messages)
        prompt = self._counted(model, texts, images)
        script = script_for(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            reasoning_effort=reasoning_effort,
            images=images,
            serial=serial,
        )
        cached = self._cached(model, messages, texts) if prompt >= MIN_TOKENS else (0, 0)
        return Decided(script, prompt, serial, *cached)

    def _cached(self, model: str, messages: list[SimMessage], texts: list[str]) -> tuple[int, int]:
        """(tokens read from the prompt cache, tokens written to it) of a prompt whose
        messages have ``texts`` (:mod:`.prompt_cache`; each message counted as in
        :meth:`decide`)."""
        parts = [
            (
                (m.role + "\0" + text).encode(),
                3 + self.text_tokens(model, text) + m.images() * IMAGE_TOKENS,
            )
            for m, text in zip(messages, texts, strict=True)
        ]
        return self.prompt_cache.account(model, parts)

    def prompt_tokens(self, model: str, messages: list[SimMessage]) -> int:
        """The prompt's tokens, as :meth:`decide` counts them."""
        return self._counted(model, *prompt_texts(messages))

    def _counted(self, model: str, texts: list[str], images: int) -> int:
        return sum(3 + self.text_tokens(model, t) for t in texts) + 3 + images * IMAGE_TOKENS

    def prepare(self, decided: Decided, max_tokens: int | None) -> Prepared:
        """Draw the reply's timing (after the fault's draw, so seeded runs replay the same)."""
        script = decided.script
        plan = plan_reply(
            self.settings.timing,
            decided.prompt_tokens,
            max_tokens,
            self.rng,
            length=script.length,
            at_least=len(script.pieces),
            reasoning=len(script.reasoning),
        )
        return Prepared(
            script,
            plan,
            decided.prompt_tokens,
            decided.serial,
            decided.cache_read,
            decided.cache_write,
        )

    def reset(self) -> None:
        self.stats = Stats()
        self._attempts.clear()
        self.log.clear()
        self.prompt_cache = PromptCache()
