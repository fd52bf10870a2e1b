"""One ``tools/call`` through ``/mcp`` as the recorder is offered it (a value; no I/O).

``mcp/endpoint.py`` makes a :class:`ToolCall` where it makes the call's audit row and
metrics and offers it to the recorder (:meth:`~.recorder.Recorder.offer_call`, a
``send_nowait``); the writer task turns it into a line (:meth:`~.line.LineBuilder.call_line`).
It holds nothing a line must not: no key, no credential, no session id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .schema import REPLAY_HEADER

__all__ = ["REPLAY_HEADER", "ToolCall"]

#: The endpoint's statuses kept as they are; every other one is ``error`` with it in
#: ``error`` (``cancelled`` is the client's leaving: ``client_closed``, as for a chat).
KEPT = frozenset({"ok", "denied", "invalid", "timeout"})


@dataclass(frozen=True, slots=True)
class ToolCall:
    """What a recorded line of one tool call is made of."""

    #: ``trio.current_time()`` when the call began and ended.
    arrival: float
    ended: float
    server: str
    tool: str
    #: The upstream lists the tool (else its label is ``other``: a client's names are
    #: not labels).
    known: bool
    #: The client's JSON-RPC id.
    message_id: Any
    #: The arguments as the upstream got them (after ``[mcp] policies``); None when the
    #: call was refused before those policies ran (its arguments are not recorded).
    arguments: dict[str, Any] | None
    #: The endpoint's status (``ok``, ``denied``, ``timeout``, ``upstream_error``...).
    status: str
    error_code: str | None
    #: Bytes of the upstream's result.
    result_bytes: int
    #: The request's ``X-Request-Timeout-Ms`` as sent (kept when it is a number).
    timeout: str | None = None
    #: The request carried ``X-Aiserve-Replay`` (a replay's own call).
    replayed: bool = False

    def recorded_status(self) -> tuple[str, str | None]:
        """The line's ``status`` and ``error``."""
        if self.status in KEPT:
            return self.status, (self.error_code if self.status != "ok" else None)
        if self.status == "cancelled":
            return "client_closed", None
        detail = f"{self.status}:{self.error_code}" if self.error_code else self.status
        return "error", detail
