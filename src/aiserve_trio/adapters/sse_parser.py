"""An incremental Server-Sent Events parser (sans-IO): bytes in, events out.

It follows the WHATWG event-stream rules that matter for model backends: lines
end in ``\\n``, ``\\r\\n`` or ``\\r`` and may be split anywhere across reads
(even between the ``\\r`` and the ``\\n``); ``data:`` lines of one event are
joined with ``\\n``; lines starting with ``:`` are comments (``: ping``
keep-alives) and are dropped; a blank line ends the event; an event with no
``data`` is not dispatched. Bytes are decoded per line, so a multi-byte UTF-8
character split across reads is reassembled first.

Model backends end their lines with ``\n``: a read with no ``\r`` in it (and
none pending) takes a fast path that decodes all its complete lines at once and
splits them as text; any other read goes line by line. Both give the same events
(the tests feed every split of a mixed stream). A read that is nothing but whole
one-line ``data:`` events can also be taken as one JSON array of their data
(:meth:`SSEParser.whole_data_array`), for a decoder that decodes them in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SSEDecodeError(ValueError):
    """The stream is not UTF-8 or a line grew past the parser's limit."""


@dataclass(slots=True)
class Event:
    data: str
    event: str = "message"
    id: str | None = None


@dataclass(slots=True)
class SSEParser:
    """Feed it bytes as they arrive; it returns the events they completed."""

    #: Longest line accepted (a backend sending an endless line is broken).
    max_line: int = 1 << 20
    _buf: bytearray = field(default_factory=bytearray)
    _data: list[str] = field(default_factory=list)
    _event: str = ""
    _id: str | None = None
    _skip_lf: bool = False

    def feed(self, chunk: bytes) -> list[Event]:
        """Parse ``chunk``; return the events it completed, in order.

        Raises:
            SSEDecodeError: a line is not UTF-8 or is longer than ``max_line``.
        """
        if not self._skip_lf and b"\r" not in chunk:
            return self._feed_lf(chunk)
        out: list[Event] = []
        buf = self._buf
        for b in chunk.splitlines(keepends=True):
            if self._skip_lf:
                self._skip_lf = False
                if b == b"\n":
                    continue
                if b.startswith(b"\n"):
                    b = b[1:]
            if b.endswith(b"\r\n"):
                buf += b[:-2]
            elif b.endswith((b"\n", b"\r")):
                # A lone CR may be the first half of a CRLF split across reads.
                self._skip_lf = b.endswith(b"\r")
                buf += b[:-1]
            else:
                buf += b
                if len(buf) > self.max_line:
                    raise SSEDecodeError(f"an SSE line exceeds {self.max_line} bytes")
                continue
            ev = self._line(bytes(buf))
            buf.clear()
            if ev is not None:
                out.append(ev)
        return out

    def whole_data_array(self, chunk: bytes, last: bytes) -> tuple[bytes, int, bool] | None:
        """The ``data`` of the events of ``chunk`` as one JSON array, when they are plain events.

        The common read of a model backend: nothing pending from earlier reads,
        and ``chunk`` is whole events of one ``data: ...`` line each, ending in
        ``\n``. Then the result is ``(b"[data1,data2,...]", number of events,
        whether the event ``data: LAST`` ended them)`` -- the data as they are,
        not yet decoded or checked, and nothing after ``LAST`` -- and the parser
        stays empty. For any other read, None, and nothing is consumed (give it
        to :meth:`feed`).
        """
        if self._buf or self._data or self._event or self._skip_lf:
            return None
        if not chunk.startswith(b"data: ") or not chunk.endswith(b"\n\n") or b"\r" in chunk:
            return None
        body = chunk[6:-2]
        data = body.split(b"\n\ndata: ")
        # No line break but the blank lines between events: one data line per event.
        if body.count(b"\n") != 2 * (len(data) - 1):
            return None
        done = last in data
        if done:
            del data[data.index(last) :]
        return b"[" + b",".join(data) + b"]", len(data), done

    def _feed_lf(self, chunk: bytes) -> list[Event]:
        """:meth:`feed` for a read whose lines all end in ``\n``."""
        buf = self._buf
        end = chunk.rfind(b"\n")
        if end < 0:  # no line ends here
            buf += chunk
            if len(buf) > self.max_line:
                raise SSEDecodeError(f"an SSE line exceeds {self.max_line} bytes")
            return []
        whole = chunk[:end]
        if buf:
            whole = bytes(buf) + whole
            buf.clear()
        buf += chunk[end + 1 :]
        if len(buf) > self.max_line:
            raise SSEDecodeError(f"an SSE line exceeds {self.max_line} bytes")
        try:
            text = whole.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEDecodeError("an SSE line is not valid UTF-8") from exc
        out: list[Event] = []
        data = self._data
        for line in text.split("\n"):
            if line.startswith("data:"):
                data.append(line[6:] if line.startswith(" ", 5) else line[5:])
            elif not line:
                if data:
                    out.append(
                        Event(data="\n".join(data), event=self._event or "message", id=self._id)
                    )
                    data.clear()
                self._event = ""
            elif not line.startswith(":"):
                self._field(line)
        return out

    def _field(self, line: str) -> None:
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value

    def _line(self, raw: bytes) -> Event | None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEDecodeError("an SSE line is not valid UTF-8") from exc
        if not line:
            if not self._data:
                self._event = ""
                return None
            ev = Event(data="\n".join(self._data), event=self._event or "message", id=self._id)
            self._data.clear()
            self._event = ""
            return ev
        if not line.startswith(":"):
            self._field(line)
        return None
