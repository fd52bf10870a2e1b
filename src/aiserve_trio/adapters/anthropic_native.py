"""Anthropic's event stream on a native route (sans-IO): each event kept as sent.

A client that speaks the Messages API to a ``messages`` route whose backend is
``anthropic`` gets the provider's own events (``apis/messages.py``'s native
framer). This decoder reads the stream as :class:`~.anthropic_stream.AnthropicStreamDecoder`
does -- text, thinking, tool input, the stop reason and the usage, for the
pipeline's policies, sessions, spend and audit -- and hands each event on with
its bytes (:class:`~aiserve_trio.api.NativeEvents`):

- consecutive ``text_delta`` or ``thinking_delta`` events of one block in one
  read become one delta (their bytes joined), as the translated decoder joins them;
- a tool's ``content_block_start`` and ``input_json_delta`` carry the call's fragment;
- every other event (a block's start or stop, ``signature_delta``, ``citations_delta``,
  ``message_start``, ``message_delta``, ``message_stop``, events unknown today) is a
  *boundary*: the text the output policies held back goes out before it;
- ``ping`` is dropped: the gateway sends its own keep-alive.
"""

from __future__ import annotations

import msgspec

from ..api import NativeEvents
from ..errors import UpstreamError
from .anthropic_stream import AnthropicStreamDecoder, _event_decoder
from .base import Delta
from .pieces import Pieces, malformed
from .sse_parser import SSEDecodeError

__all__ = ["AnthropicNativeDecoder"]

_TEXT = frozenset({"text_delta", "thinking_delta"})


class AnthropicNativeDecoder(AnthropicStreamDecoder):
    """One native reply's event stream, decoded read by read (see the module docstring)."""

    __slots__ = ()

    def feed(self, data: bytes) -> list[Delta]:
        self.check()
        out: list[Delta] = []
        if self.done:
            return out
        # The text events of one block, joined until another event comes.
        raw: list[bytes] = []
        pieces = Pieces()
        index = -1
        try:
            for event in self._parser.feed(data):
                ev = _event_decoder.decode(event.data)
                kind = ev.type
                if kind == "ping":
                    continue
                encoded = b"event: %s\ndata: %s\n\n" % (event.event.encode(), event.data.encode())
                text = kind == "content_block_delta" and ev.delta is not None and ev.delta.type
                if text in _TEXT:
                    if raw and index != ev.index:
                        _flush(out, raw, pieces, index)
                    index = ev.index
                    self._event(ev, pieces)
                    raw.append(encoded)
                    continue
                if raw:
                    _flush(out, raw, pieces, index)
                call = self._event(ev, pieces)
                events = NativeEvents(raw=encoded, kind=kind, index=ev.index, boundary=call is None)
                out.append(Delta(tool_calls=[call] if call else None, native=events))
                if self.done:
                    break
        except UpstreamError as reported:
            self._error = reported
        except (SSEDecodeError, msgspec.DecodeError) as exc:
            self._error = malformed(self.name, exc)
        if raw:
            _flush(out, raw, pieces, index)
        return out


def _flush(out: list[Delta], raw: list[bytes], pieces: Pieces, index: int) -> None:
    """The text events so far as one delta (``raw`` and ``pieces`` emptied)."""
    joined: list[Delta] = []
    pieces.flush(joined)
    events = NativeEvents(raw=b"".join(raw), kind="content_block_delta", index=index)
    if joined:
        d = joined[0]
        out.append(Delta(text=d.text, reasoning=d.reasoning, tokens=d.tokens, native=events))
    else:  # empty pieces: still the provider's events
        out.append(Delta(native=events, tokens=0))
    raw.clear()
