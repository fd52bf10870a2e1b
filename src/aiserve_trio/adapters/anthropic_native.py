"""Anthropic's event stream on a native route (sans-IO): each event kept as sent.

A client that speaks the Messages API to a ``messages`` route whose backend is
``anthropic`` gets the provider's own events (``apis/messages.py``'s native
framer). This decoder reads the stream as :class:`~.anthropic_stream.AnthropicStreamDecoder`
does -- text, thinking, tool input, the stop reason and the usage, for the
pipeline's policies, sessions, spend and audit -- and hands each event on with
its bytes (:class:`~aiserve_trio.core.api.NativeEvents`):

- consecutive ``text_delta`` or ``thinking_delta`` events of one block in one
  read become one delta (their bytes joined), as the translated decoder joins them;
- a tool's ``content_block_start`` and ``input_json_delta`` carry the call's fragment;
- every other event (a block's start or stop, ``signature_delta``, ``citations_delta``,
  ``message_start``, ``message_delta``, ``message_stop``, events unknown today) is a
  *boundary*: the text the output policies held back goes out before it;
- ``ping`` is dropped: the gateway sends its own keep-alive.
"""

from __future__ import annotations

from typing import Any

from .anthropic_stream import AnthropicStreamDecoder, _event_decoder
from .base import Delta
from .pieces import NativeText, encoded, one_event
from .sse_parser import Event

__all__ = ["AnthropicNativeDecoder"]

_TEXT = frozenset({"text_delta", "thinking_delta"})


class AnthropicNativeDecoder(AnthropicStreamDecoder):
    """One native reply's event stream, decoded read by read (see the module docstring)."""

    __slots__ = ()

    def _held(self) -> NativeText:
        return NativeText()

    def _read(self, event: Event, held: Any, out: list[Delta]) -> None:
        ev = _event_decoder.decode(event.data)
        if ev.type == "ping":
            return
        raw = encoded(event)
        kind = ev.delta.type if ev.type == "content_block_delta" and ev.delta else ""
        if kind in _TEXT:
            self._event(ev, held.add((ev.index, ev.type), raw, out))
            return
        held.flush(out)
        call = self._event(ev, held.pieces)
        alone = Delta(tool_calls=[call]) if call is not None else None
        out.append(one_event(alone, raw, ev.type, ev.index))
