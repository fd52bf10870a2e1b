"""Speech to text as the sim plays it (pure): the multipart request, the transcript.

``POST /v1/audio/transcriptions`` takes OpenAI's ``multipart/form-data``: a
``file`` part (the audio; its format from the file name's extension, else its
``Content-Type``) and a ``model`` field, optionally ``response_format``
(``json``, the default, or ``text``). The sim cannot recognise speech: what it
hears is decided by ``util/wav.py``, the same rule the gateway's mock model follows
-- a WAV's ``LIST``/``INFO`` comment, else a sentence naming its length; mp3
audio as a sentence naming its size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..util.wav import FORMATS, WavError, transcript

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.I)
_DISPOSITION = re.compile(rb'name="([^"]*)"(?:; *filename="([^"]*)")?', re.I)
_MIME_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/mpeg": "mp3"}


class FormError(ValueError):
    """The request is not a transcription form the sim can read (a 400)."""


@dataclass(frozen=True, slots=True)
class Transcription:
    """A decoded transcription request."""

    model: str
    audio: bytes
    format: str
    response_format: str


def parse_form(content_type: str | None, body: bytes) -> Transcription:
    """Read a transcription request.

    Raises:
        FormError: not ``multipart/form-data``, no ``file`` or ``model``, an
            audio format other than wav or mp3, an unknown ``response_format``.
    """
    if content_type is None or not content_type.lower().startswith("multipart/form-data"):
        raise FormError("a transcription request is multipart/form-data")
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise FormError("the multipart/form-data content type names no boundary")
    sep = b"--" + m.group(1).encode("latin-1")
    fields: dict[str, str] = {}
    audio: bytes | None = None
    fmt: str | None = None
    for chunk in body.split(sep)[1:]:
        if chunk.startswith(b"--"):
            break  # the closing delimiter
        head, _, value = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        value = value.removesuffix(b"\r\n")
        disposition = _DISPOSITION.search(head)
        if disposition is None:
            raise FormError("a form part has no Content-Disposition name")
        name = disposition.group(1).decode("latin-1")
        if name == "file":
            audio = value
            filename = (disposition.group(2) or b"").decode("latin-1")
            fmt = _format(filename, head)
        else:
            fields[name] = value.decode("utf-8", "replace")
    if audio is None:
        raise FormError("the form has no `file` part")
    if not fields.get("model"):
        raise FormError("the form has no `model` field")
    if fmt not in FORMATS:
        raise FormError(f"the audio must be one of {', '.join(FORMATS)} (by file name or type)")
    response_format = fields.get("response_format", "json")
    if response_format not in ("json", "text"):
        raise FormError("`response_format` must be json or text")
    return Transcription(fields["model"], audio, fmt, response_format)


def _format(filename: str, head: bytes) -> str | None:
    ext = filename.rpartition(".")[2].lower() if "." in filename else ""
    if ext in FORMATS:
        return ext
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-type:"):
            mime = line.split(b":", 1)[1].strip().decode("latin-1").lower()
            return _MIME_FORMATS.get(mime)
    return None


def hear(request: Transcription) -> str:
    """The transcript (``util/wav.py``'s rule).

    Raises:
        FormError: a ``wav`` file that is not a WAV file.
    """
    try:
        return transcript(request.audio, request.format)
    except WavError as exc:
        raise FormError(str(exc)) from None
