"""A provider's wire format in the sim: how a request is read and a reply is written.

The sim decides what a reply says and when each piece is due once, whatever the
provider (:mod:`.reply`, :mod:`.model`). A dialect is the pure part that speaks a
provider's format around that: it reads the provider's request into a
:class:`SimAsk` and renders the reply's opening, each token, the closing, a whole
(non-streamed) body and error bodies as that provider sends them. The shell in
:mod:`.app` paces and sends those bytes; nothing here does I/O.

``aiserve-sim`` serves every dialect at once, each under its own paths;
``--dialect NAME`` serves only that one (and OpenAI's own format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .core import Prepared
from .request import ResponseFormat, SimMessage, Tool, ToolChoice

#: The dialects ``--dialect`` names.
DIALECTS = ("anthropic", "azure", "gemini", "bedrock", "responses")


class DialectError(ValueError):
    """A request the dialect refuses, with the status (400 unless said) the provider gives."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class SimAsk:
    """A provider request, read into what the sim decides a reply from."""

    model: str
    messages: list[SimMessage]
    stream: bool
    max_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    #: What renders this request's reply when it is not the dialect that read it: an
    #: instance of the dialect for this request alone (the Responses dialect's numbers
    #: its events and echoes the request).
    render: Dialect | None = None


class Dialect(Protocol):
    """One provider's wire format (see the module docstring)."""

    name: str
    #: The streamed reply's ``content-type``.
    stream_type: bytes

    def matches(self, method: str, path: str) -> bool:
        """Whether this dialect answers ``method path``."""
        ...

    def auth_error(self, headers: dict[str, str]) -> tuple[int, bytes] | None:
        """(status, body) when the request lacks the provider's auth; None: it has it."""
        ...

    def read(self, path: str, query: str, body: bytes) -> SimAsk:
        """The request.

        Raises:
            DialectError, msgspec.DecodeError, ValueError: the provider would refuse it.
        """
        ...

    def error(self, status: int, message: str) -> bytes:
        """An error body with ``status`` in the provider's shape."""
        ...

    def opening(self, ready: Prepared, model: str) -> bytes:
        """What a stream starts with, before its first token."""
        ...

    def token(self, ready: Prepared, k: int) -> bytes:
        """Output token ``k`` (reasoning first, then the visible pieces)."""
        ...

    def closing(self, ready: Prepared, model: str) -> bytes:
        """What a stream ends with: the finish reason, the usage, the end."""
        ...

    def whole(self, ready: Prepared, model: str) -> bytes:
        """The non-streamed reply's body."""
        ...
