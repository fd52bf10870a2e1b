"""OpenAI's Responses event stream on a native route (sans-IO): each event kept as sent.

A Responses client on a ``responses`` route whose backend speaks Responses (an ``openai``
adapter with ``wire = "responses"``) gets the provider's own events
(``apis/responses_native.py``'s framer). This decoder reads the stream as
:class:`~.responses_stream.ResponsesStreamDecoder` does -- text, reasoning, refusals,
function calls, the usage and the end, for the pipeline's policies, spend, sessions and
audit -- and hands each event on with its bytes (:class:`~aiserve_trio.api.NativeEvents`,
``index`` the event's ``output_index``):

- consecutive text deltas of one item and kind in one read become one delta (their
  bytes joined);
- a function call's ``output_item.added`` and argument deltas carry the call's fragment;
- every other event is a *boundary*: the text the output policies held back goes out
  before it (``*.done`` events repeat an item's whole text: the framer writes them again
  when the policies changed it).
"""

from __future__ import annotations

import msgspec

from ..api import NativeEvents
from ..errors import UpstreamError
from .base import Delta
from .pieces import Pieces, malformed
from .responses_stream import _TEXT, ResponsesStreamDecoder, _event_decoder
from .sse_parser import SSEDecodeError

__all__ = ["ResponsesNativeDecoder"]

_JOINED = frozenset(k for k, which in _TEXT.items() if which != "refusal")


class ResponsesNativeDecoder(ResponsesStreamDecoder):
    """One native reply's Responses events, decoded read by read (see the module docstring)."""

    __slots__ = ()

    def feed(self, data: bytes) -> list[Delta]:
        self.check()
        out: list[Delta] = []
        if self.done:
            return out
        raw: list[bytes] = []
        pieces = Pieces()
        at: tuple[int, str] = (-1, "")
        try:
            for event in self._parser.feed(data):
                ev = _event_decoder.decode(event.data)
                encoded = b"event: %s\ndata: %s\n\n" % (event.event.encode(), event.data.encode())
                if ev.type in _JOINED and ev.delta:
                    if raw and at != (ev.output_index, ev.type):
                        _flush(out, raw, pieces, at)
                    at = (ev.output_index, ev.type)
                    self._event(ev, pieces)
                    raw.append(encoded)
                    continue
                if raw:
                    _flush(out, raw, pieces, at)
                alone = self._event(ev, pieces)
                whole: list[Delta] = []
                pieces.flush(whole)  # a text a server sent whole (a .done with no delta before)
                delta = alone or (whole[0] if whole else Delta(tokens=0))
                carries = bool(delta.text or delta.reasoning or delta.refusal or delta.tool_calls)
                events = NativeEvents(
                    raw=encoded, kind=ev.type, index=ev.output_index, boundary=not carries
                )
                out.append(msgspec.structs.replace(delta, native=events))
                if self.done:
                    break
        except UpstreamError as reported:
            self._error = reported
        except (SSEDecodeError, msgspec.DecodeError) as exc:
            self._error = malformed(self.name, exc)
        if raw:
            _flush(out, raw, pieces, at)
        return out


def _flush(out: list[Delta], raw: list[bytes], pieces: Pieces, at: tuple[int, str]) -> None:
    """The text events so far as one delta (``raw`` and ``pieces`` emptied)."""
    joined: list[Delta] = []
    pieces.flush(joined)
    events = NativeEvents(raw=b"".join(raw), kind=at[1], index=at[0])
    d = joined[0] if joined else Delta(tokens=0)
    out.append(msgspec.structs.replace(d, native=events))
    raw.clear()
