"""OpenAI's Responses event stream on a native route (sans-IO): each event kept as sent.

A Responses client on a ``responses`` route whose backend speaks Responses (an ``openai``
adapter with ``wire = "responses"``) gets the provider's own events
(``apis/responses_native.py``'s framer). This decoder reads the stream as
:class:`~.responses_stream.ResponsesStreamDecoder` does -- text, reasoning, refusals,
function calls, the usage and the end, for the pipeline's policies, spend, sessions and
audit -- and hands each event on with its bytes (:class:`~aiserve_trio.core.api.NativeEvents`,
``index`` the event's ``output_index``):

- consecutive text deltas of one item and kind in one read become one delta (their
  bytes joined);
- a function call's ``output_item.added`` and argument deltas carry the call's fragment;
- every other event is a *boundary*: the text the output policies held back goes out
  before it (``*.done`` events repeat an item's whole text: the framer writes them again
  when the policies changed it).
"""

from __future__ import annotations

from typing import Any

from .base import Delta
from .pieces import NativeText, encoded, one_event
from .responses_stream import _TEXT, ResponsesStreamDecoder, _event_decoder
from .sse_parser import Event

__all__ = ["ResponsesNativeDecoder"]

_JOINED = frozenset(k for k, which in _TEXT.items() if which != "refusal")


class ResponsesNativeDecoder(ResponsesStreamDecoder):
    """One native reply's Responses events, decoded read by read (see the module docstring)."""

    __slots__ = ()

    def _held(self) -> NativeText:
        return NativeText()

    def _read(self, event: Event, held: Any, out: list[Delta]) -> None:
        ev = _event_decoder.decode(event.data)
        raw = encoded(event)
        if ev.type in _JOINED and ev.delta:
            self._event(ev, held.add((ev.output_index, ev.type), raw, out))
            return
        held.flush(out)
        alone = self._event(ev, held.pieces)
        whole: list[Delta] = []
        held.pieces.flush(whole)  # a text a server sent whole (a .done, no delta before)
        out.append(one_event(alone or (whole[0] if whole else None), raw, ev.type, ev.output_index))
