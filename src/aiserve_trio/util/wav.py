"""WAV files that carry their own transcript: made and read back (pure).

A simulator cannot recognise speech, so the ``mock`` model and ``aiserve-sim``
agree on a deterministic stand-in for speech to text:

- a WAV file's transcript is the text of its ``LIST``/``INFO`` comment
  (``ICMT``), the chunk audio tools keep notes in;
- a WAV without one is heard as ``[1.5 seconds of audio without speech]`` (its
  length, from the ``fmt`` and ``data`` chunks);
- audio in another format (``mp3``) as ``[4096 bytes of mp3 audio without speech]``.

:func:`make_wav` builds such a file: silence of the given length with the
comment. ``python -m aiserve_trio.util.wavtool`` does it from a shell, and prints a
chat request carrying a WAV as an ``input_audio`` part (``util/wavtool.py``).

Like ``util/vectors.py``, imported by the mock model and by ``aiserve-sim``, so the
two hear the same thing.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

#: The formats OpenAI's ``input_audio`` content parts take.
FORMATS = ("wav", "mp3")
_PCM = 1


class WavError(ValueError):
    """The bytes are not a WAV file this module can read."""


@dataclass(frozen=True, slots=True)
class WavInfo:
    """What a WAV file says about itself."""

    #: Seconds of audio (``data`` bytes over the byte rate).
    seconds: float
    #: The ``LIST``/``INFO`` ``ICMT`` comment, or None.
    comment: str | None


def _chunk(tag: bytes, body: bytes) -> bytes:
    pad = b"\0" if len(body) % 2 else b""
    return tag + struct.pack("<I", len(body)) + body + pad


def make_wav(transcript: str | None, seconds: float = 1.0, *, rate: int = 8000) -> bytes:
    """A mono 16-bit PCM WAV of ``seconds`` of silence whose comment is ``transcript``.

    Args:
        transcript: the ``ICMT`` text (UTF-8); None: no ``LIST`` chunk at all.
        seconds: the audio's length.
        rate: samples per second.
    """
    channels, bits = 1, 16
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", _PCM, channels, rate, rate * block, block, bits)
    chunks = _chunk(b"fmt ", fmt)
    if transcript is not None:
        info = b"INFO" + _chunk(b"ICMT", transcript.encode("utf-8") + b"\0")
        chunks += _chunk(b"LIST", info)
    chunks += _chunk(b"data", bytes(int(seconds * rate) * block))
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def read_wav(data: bytes) -> WavInfo:
    """The length and comment of a WAV file.

    Raises:
        WavError: not a RIFF/WAVE file, a chunk runs past the end, no ``fmt``
            or ``data`` chunk.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError("not a WAV file (no RIFF/WAVE header)")
    byte_rate: int | None = None
    frames: int | None = None
    comment: str | None = None
    pos = 12
    while pos + 8 <= len(data):
        tag = data[pos : pos + 4]
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = data[pos + 8 : pos + 8 + size]
        if len(body) < size:
            raise WavError(f"the {tag.decode('latin-1')!r} chunk runs past the end of the file")
        if tag == b"fmt " and size >= 16:
            byte_rate = struct.unpack_from("<I", body, 8)[0]
        elif tag == b"data":
            frames = size
        elif tag == b"LIST" and body[:4] == b"INFO":
            comment = _info_comment(body[4:]) or comment
        pos += 8 + size + (size % 2)
    if byte_rate is None or frames is None:
        raise WavError("a WAV file needs a `fmt ` and a `data` chunk")
    return WavInfo(seconds=frames / byte_rate if byte_rate else 0.0, comment=comment)


def _info_comment(info: bytes) -> str | None:
    pos = 0
    while pos + 8 <= len(info):
        tag = info[pos : pos + 4]
        (size,) = struct.unpack_from("<I", info, pos + 4)
        if tag == b"ICMT":
            text = info[pos + 8 : pos + 8 + size].split(b"\0", 1)[0]
            return text.decode("utf-8", "replace").strip() or None
        pos += 8 + size + (size % 2)
    return None


def transcript(audio: bytes, fmt: str) -> str:
    """What the mock and ``aiserve-sim`` hear in ``audio`` (see the module docstring).

    Raises:
        WavError: ``fmt`` is ``wav`` but the bytes are not a readable WAV file.
    """
    if fmt != "wav":
        return f"[{len(audio)} bytes of {fmt} audio without speech]"
    info = read_wav(audio)
    if info.comment is not None:
        return info.comment
    return f"[{info.seconds:.1f} seconds of audio without speech]"


def audio_part(audio: bytes, fmt: str = "wav") -> dict[str, object]:
    """An OpenAI ``input_audio`` content part carrying ``audio``."""
    data = base64.b64encode(audio).decode("ascii")
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}
