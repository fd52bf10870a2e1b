"""What the provider decoders' tests share: feed a stream in pieces, and what a reply said."""

from __future__ import annotations

from aiserve_trio.adapters.base import Delta
from aiserve_trio.adapters.native import StreamDecoder

#: (text, reasoning, tool-call fragments as (index, id, name, arguments)).
Said = tuple[str, str, list[tuple[int, str | None, str | None, str]]]


def pieces(stream: bytes, cuts: list[int]) -> list[bytes]:
    """``stream`` cut at ``cuts`` (any order, repeats allowed)."""
    points = sorted({c % (len(stream) + 1) for c in cuts})
    return [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]


def decode(decoder: StreamDecoder, chunks: list[bytes]) -> tuple[list[Delta], Delta]:
    """Every delta of ``chunks`` fed in order (checked after each), and the final one."""
    out: list[Delta] = []
    for c in chunks:
        out += decoder.feed(c)
        decoder.check()
    return out, decoder.end()


def said(deltas: list[Delta]) -> Said:
    calls = [(c.index, c.id, c.name, c.arguments) for d in deltas for c in d.tool_calls or []]
    return "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas), calls
