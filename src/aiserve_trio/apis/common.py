"""What the API codecs share: the codec and framer shapes, the stream's state table,
event framing, msgspec errors as 400s, usage details (pure)."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from ..core.api import ChatCompletion, ChunkDelta, NativeEvents
from ..core.api import Usage as WireUsage
from ..core.errors import BadRequest, GatewayError


class Framer(Protocol):
    """One streamed reply in an API's events: ``role`` opens it, ``delta`` frames what the
    response assembler released, ``close`` ends it, ``fail`` ends it with an error."""

    #: The model the events name (the one that answered, once the first delta says).
    model: str

    def role(self) -> bytes: ...

    def delta(self, delta: ChunkDelta, logprobs: msgspec.Raw | None = None) -> bytes: ...

    def close(self, finish_reason: str, usage: WireUsage) -> bytes: ...

    def fail(self, err: GatewayError) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Codec:
    """A client API at the pipeline's edge (see the package docstring)."""

    kind: str
    #: The stream's keep-alive event.
    ping: bytes
    #: A request body -> the pipeline's Chat Completions body, and the request as sent;
    #: the very same bytes when the body is the pipeline's own already (Chat
    #: Completions): nothing was translated.
    decode: Callable[[bytes], tuple[bytes, object]]
    #: (reply id, model, created, the request as sent, whether the client asked for
    #: the usage in the stream) -> the stream's framer. An API whose stream always
    #: reports the usage (Responses, Messages) ignores the last.
    framer: Callable[[str, str, int, object, bool], Framer]
    #: The whole reply, for a client that did not stream.
    body: Callable[[ChatCompletion, object], bytes]
    #: Any gateway error as the API's status and body, before the response head.
    error: Callable[[GatewayError], tuple[int, bytes]]
    #: The view of a request a translated route serves (the backend speaks another
    #: API): what it drops named, or a 400 for what it cannot carry.
    translated: Callable[[object], object] = lambda view: view
    #: How the API passes through to a backend that speaks it; None: never.
    native: NativeSpec | None = None
    #: The API stores each reply under its own id and continues a stored one
    #: (Responses): the request as sent -> what it asks of that; None: it does not.
    stored: Callable[[object], Stored] | None = None
    #: How a reply's id (and the request's ``X-Request-Id``) begins.
    id_prefix: str = "chatcmpl-"
    #: The reply echoes the request (Responses): (the request as sent, the input
    #: policies' text rewrite, the metadata as stored) -> in steps, the request as the
    #: reply echoes it; None: the reply echoes nothing the policies rewrite.
    echo: (
        Callable[
            [object, Callable[[str], str], dict[str, str] | None],
            Generator[None, None, object],
        ]
        | None
    ) = None


@dataclass(frozen=True, slots=True)
class Stored:
    """What a request of an API that stores its replies asks of the gateway's store."""

    #: Its turns and the reply are stored under the reply's id (Responses' ``store``).
    store: bool
    #: The stored reply it continues (``previous_response_id``), if any.
    previous: str | None


class NativeFramer(Framer, Protocol):
    """A framer of a native stream: the provider's events pass as they are."""

    def native(self, events: NativeEvents, released: ChunkDelta | None, *, same: bool) -> bytes:
        """The provider's events as they came (``same``: the output policies released
        the text they hold, ``released``, unchanged), or what the policies released of
        it written as events of the same block (``events.raw`` empty: text they held
        back, released before a boundary)."""
        ...


@dataclass(frozen=True, slots=True)
class NativeSpec:
    """Native pass-through (the client speaks the backend's API): the body goes as
    the client sent it (the parse stage keeps its bytes), the events come back as the
    provider sent them."""

    #: The client's request headers that reach the provider as sent.
    headers: tuple[str, ...]
    #: (a body, a session's earlier turns as ``{"role", "content"}``) -> the body
    #: with them before the client's own.
    history: Callable[[bytes, list[dict[str, Any]]], bytes]
    #: (a body, a text rewrite) -> in steps, the body with the text of its
    #: messages rewritten (the input policies), the same bytes when unchanged.
    rewrite: Callable[[bytes, Callable[[str], str]], Generator[None, None, bytes]]
    #: (reply id, model, created, the view) -> the native stream's framer.
    framer: Callable[[str, str, int, object], NativeFramer]
    #: A whole native event stream -> the reply's body (a client that did not stream).
    collect: Callable[[bytes], bytes]


class State(enum.Enum):
    """Where one reply is: the API framers' streams and the response assembler share it."""

    IDLE = "idle"
    OPEN = "open"
    DONE = "done"
    FAILED = "failed"


_STREAM: dict[tuple[State, str], State] = {
    (State.IDLE, "role"): State.OPEN,
    (State.OPEN, "delta"): State.OPEN,
    (State.OPEN, "close"): State.DONE,
    (State.IDLE, "fail"): State.FAILED,
    (State.OPEN, "fail"): State.FAILED,
}


class FramerStateError(RuntimeError):
    """A call the framer's state does not allow (a bug in the caller)."""


class Stream:
    """Where a framer's stream is: ``role``, ``delta``..., then ``close`` or ``fail``."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.IDLE

    def go(self, call: str) -> None:
        """Raises: FramerStateError: ``call`` is not allowed now."""
        try:
            self.state = _STREAM[self.state, call]
        except KeyError:
            raise FramerStateError(f"{call} in state {self.state.value}") from None


encoder = msgspec.json.Encoder()
_details = msgspec.json.Decoder(dict[str, Any])
_UNKNOWN = re.compile(
    r"^Object contains unknown field `(?P<field>[^`]+)`(?: - at `\$\.?(?P<at>.*)`)?$"
)
_MISSING = re.compile(
    r"^Object missing required field `(?P<field>[^`]+)`(?: - at `\$\.?(?P<at>.*)`)?$"
)
_AT = re.compile(r"^(?P<msg>.*) - at `\$\.?(?P<at>[^`]*)`$")


def rewrite_strings(value: Any, rewrite: Callable[[str], str]) -> Any:
    """Every string inside a JSON value (a tool's input or arguments) through ``rewrite``."""
    if isinstance(value, str):
        return rewrite(value)
    if isinstance(value, list):
        return [rewrite_strings(v, rewrite) for v in value]
    if isinstance(value, dict):
        return {k: rewrite_strings(v, rewrite) for k, v in value.items()}
    return value


def event(name: bytes, payload: bytes) -> bytes:
    """One named Server-Sent Event."""
    return b"event: %s\ndata: %s\n\n" % (name, payload)


def refuse(param: str, why: str) -> BadRequest:
    """A 400 naming a field the gateway cannot carry: it is refused, never dropped."""
    return BadRequest(f"`{param}` {why}", param=param, code="unsupported_field")


def only(obj: dict[str, Any], where: str, allowed: tuple[str, ...]) -> None:
    """Refuse, naming it, a field of ``obj`` (at ``where``) that is set and not ``allowed``.

    Raises:
        BadRequest: ``unsupported_field``.
    """
    for key, value in obj.items():
        if key not in allowed and value is not None:
            raise refuse(f"{where}.{key}", "has no equivalent; it is not sent anywhere")


def described(err: GatewayError) -> str:
    """The error's message, with the field or stage it is about when it does not say it."""
    if err.param and err.param not in err.message:
        return f"{err.message} ({err.param})"
    return err.message


def string(obj: dict[str, Any], key: str, at: str) -> str:
    """``obj[key]``, a string (absent: empty).

    Raises:
        BadRequest: it is there and not a string.
    """
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise invalid(f"{at}.{key}", "must be a string")
    return value


def invalid(param: str, why: str) -> BadRequest:
    return BadRequest(f"`{param}` {why}", param=param, code="invalid_value")


def decode_error(exc: msgspec.MsgspecError) -> BadRequest:
    """A msgspec error of an API request as a 400 naming the field."""
    msg = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        if m := _UNKNOWN.match(msg):
            param = _join(m["at"], m["field"])
            return refuse(param, "has no equivalent on this gateway; it is not sent anywhere")
        if m := _MISSING.match(msg):
            param = _join(m["at"], m["field"])
            return BadRequest(
                f"`{param}`: field required", param=param, code="missing_required_parameter"
            )
        if m := _AT.match(msg):
            at: str | None = m["at"] or None
            return BadRequest(f"invalid request: {m['msg']}", param=at, code="invalid_type")
        return BadRequest(f"invalid request: {msg}", code="invalid_type")
    return BadRequest(f"request body is not valid JSON: {msg}", code="invalid_json")


def _join(at: str | None, field: str) -> str:
    return f"{at}.{field}" if at else field


def detail(raw: msgspec.Raw | msgspec.UnsetType, key: str) -> int:
    """A count in a usage details object (``cached_tokens``, ...); 0 when absent."""
    if isinstance(raw, msgspec.UnsetType):
        return 0
    try:
        value = _details.decode(raw).get(key)
    except msgspec.DecodeError:
        return 0
    return max(0, value) if isinstance(value, int) else 0


def counts(usage: WireUsage) -> tuple[int, int, int, int]:
    """(input, output, cached input, reasoning output) tokens of a usage (the cached part
    at most the input)."""
    return (
        usage.prompt_tokens,
        usage.completion_tokens,
        min(detail(usage.prompt_tokens_details, "cached_tokens"), max(0, usage.prompt_tokens)),
        detail(usage.completion_tokens_details, "reasoning_tokens"),
    )


def image_url(url: str, detail_: str | None = None) -> dict[str, Any]:
    """A Chat Completions image part."""
    inner: dict[str, Any] = {"url": url}
    if detail_ is not None:
        inner["detail"] = detail_
    return {"type": "image_url", "image_url": inner}


# --- values every provider refuses (issue 51, item 4) ---------------------------------
# Checked at decode, on native routes too: each is as invalid to the provider that speaks
# the client's API, which would answer 400 after a round trip.

#: A tool's name: 1 to 128 characters, none of them a space or a control character.
_TOOL_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,128}")
#: Base64 (standard alphabet, padding optional: only what no decoder reads is refused).
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
#: The image types the providers read.
IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


def tool_name(value: Any, at: str) -> str:
    """A tool's name.

    Raises:
        BadRequest: not a string, empty, over 128 characters, or with a space or a
            control character (a CRLF in a name is no name any provider takes).
    """
    if not isinstance(value, str):
        raise invalid(at, "must be a string")
    if not _TOOL_NAME.fullmatch(value):
        raise invalid(at, "must be 1 to 128 characters, without spaces or control characters")
    return value


def json_schema(value: Any, at: str) -> dict[str, Any]:
    """A tool's parameters: a JSON Schema, which is an object.

    Raises:
        BadRequest: it is a string, a list, a number...
    """
    if not isinstance(value, dict):
        raise invalid(at, "must be a JSON Schema object")
    return value


def base64_data(value: Any, at: str) -> str:
    """Base64-encoded data (an image's, a document's).

    Raises:
        BadRequest: not a string of base64.
    """
    if not isinstance(value, str) or not value or not _BASE64.fullmatch(value):
        raise invalid(at, "must be base64-encoded data")
    return value


def web_url(value: Any, at: str, *, data: bool = False) -> str:
    """A URL a provider fetches: ``http(s)://``, or (``data``) a base64 ``data:`` URL of
    an image.

    Raises:
        BadRequest: another scheme (``javascript:``, ``file:``...), a data URL of another
            type or whose data is not base64.
    """
    if not isinstance(value, str):
        raise invalid(at, "must be a string")
    scheme = value[:8].lower()
    if scheme.startswith(("http://", "https://")):
        return value
    if data and scheme.startswith("data:"):
        head, sep, payload = value.partition(",")
        kind = head[5:].lower()
        if not sep or not kind.endswith(";base64") or kind[:-7] not in IMAGE_TYPES:
            why = f"must be a base64 data URL of an image ({', '.join(sorted(IMAGE_TYPES))})"
            raise invalid(at, why)
        base64_data(payload, at)
        return value
    raise invalid(at, "must be an http or https URL" + (" or a data URL" if data else ""))
