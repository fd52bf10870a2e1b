"""The AWS event stream (``application/vnd.amazon.eventstream``), decoded sans-IO.

Bedrock's ``converse-stream`` answers with binary messages, each::

    total length      4 bytes, big-endian: the whole message, these 12 bytes and the CRC included
    headers length    4 bytes
    prelude CRC       4 bytes: CRC-32 of the 8 bytes before it
    headers           name length (1), name (UTF-8), value type (1), value
    payload           the rest (a JSON object for Bedrock's events)
    message CRC       4 bytes: CRC-32 of everything before it

A header's value is typed: 0 true, 1 false (no bytes), 2 byte, 3 short, 4 int,
5 long, 8 timestamp (big-endian signed), 6 bytes and 7 string (2-byte length,
then the bytes), 9 UUID (16 bytes). Both CRCs are checked: a message whose bytes
changed on the way is an error, never a wrong event. :class:`EventStreamDecoder`
is fed reads as they arrive, split anywhere, and returns the messages they
complete; there is no I/O here. (aiserve-sim's Bedrock dialect has the encoder.)
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = ["EventStreamDecoder", "EventStreamError", "Message"]

#: The largest message accepted (AWS's own limit is 16 MiB for a message).
MAX_MESSAGE = 16 * 1024 * 1024
_PRELUDE = 12
_MIN = _PRELUDE + 4
_FIXED = {2: 1, 3: 2, 4: 4, 5: 8, 8: 8, 9: 16}
HeaderValue = bool | int | bytes | str


class EventStreamError(ValueError):
    """The bytes are not an AWS event stream: a CRC mismatch, a length out of range,
    or a header that cannot be read."""


@dataclass(frozen=True, slots=True)
class Message:
    """One event-stream message: its headers (by name) and its payload."""

    headers: dict[str, HeaderValue]
    payload: bytes

    def text(self, name: str) -> str:
        """Header ``name`` as a string ('' when absent or not a string)."""
        value = self.headers.get(name)
        return value if isinstance(value, str) else ""


def _headers(data: bytes) -> dict[str, HeaderValue]:
    out: dict[str, HeaderValue] = {}
    i, end = 0, len(data)
    try:
        while i < end:
            n = data[i]
            name = data[i + 1 : i + 1 + n].decode("utf-8")
            i += 1 + n
            kind = data[i]
            i += 1
            value: HeaderValue
            if kind in (0, 1):
                value = kind == 0
            elif kind in _FIXED:
                size = _FIXED[kind]
                raw = data[i : i + size]
                if len(raw) != size:
                    raise EventStreamError("a header value runs past the headers")
                value = raw if kind == 9 else int.from_bytes(raw, "big", signed=True)
                i += size
            elif kind in (6, 7):
                (size,) = struct.unpack_from(">H", data, i)
                raw = data[i + 2 : i + 2 + size]
                if len(raw) != size:
                    raise EventStreamError("a header value runs past the headers")
                value = raw.decode("utf-8") if kind == 7 else raw
                i += 2 + size
            else:
                raise EventStreamError(f"unknown header value type {kind}")
            out[name] = value
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise EventStreamError(f"malformed headers: {exc}") from None
    return out


class EventStreamDecoder:
    """Messages out of reads (see the module docstring)."""

    __slots__ = ("_buf", "max_message")

    def __init__(self, max_message: int = MAX_MESSAGE) -> None:
        self._buf = bytearray()
        self.max_message = max_message

    @property
    def pending(self) -> int:
        """Bytes of an unfinished message held (0 at a clean end of stream)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Message]:
        """The messages ``data`` completes, in order.

        Raises:
            EventStreamError: a CRC does not match, or a length is out of range
                (the stream cannot be trusted after that).
        """
        buf = self._buf
        buf += data
        out: list[Message] = []
        start = 0
        while len(buf) - start >= _PRELUDE:
            total, header_len, prelude_crc = struct.unpack_from(">III", buf, start)
            if zlib.crc32(buf[start : start + 8]) != prelude_crc:
                raise EventStreamError("prelude CRC mismatch")
            if not _MIN <= total <= self.max_message or header_len > total - _MIN:
                raise EventStreamError(f"message length out of range ({total})")
            if len(buf) - start < total:
                break
            end = start + total
            (message_crc,) = struct.unpack_from(">I", buf, end - 4)
            if zlib.crc32(buf[start : end - 4]) != message_crc:
                raise EventStreamError("message CRC mismatch")
            head = start + _PRELUDE
            headers = _headers(bytes(buf[head : head + header_len]))
            out.append(Message(headers, bytes(buf[head + header_len : end - 4])))
            start = end
        del buf[:start]
        return out
