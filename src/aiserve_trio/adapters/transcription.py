"""OpenAI's ``POST /audio/transcriptions``, both ways (pure: no I/O).

The request is ``multipart/form-data`` with the audio as the ``file`` part and
the ``model`` (and ``response_format = json``) as fields; the answer is
``{"text": "..."}``. :func:`multipart_body` builds the request body,
:func:`read_transcript` reads the answer. The ``openai`` adapter sends one;
``aiserve-sim`` parses the same shape with its own reader (it imports nothing of
the gateway's adapters).
"""

from __future__ import annotations

import msgspec

#: MIME types of the ``input_audio`` formats.
AUDIO_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg"}


class _Transcript(msgspec.Struct):
    text: str


_transcript = msgspec.json.Decoder(_Transcript)


def multipart_body(
    boundary: str, fields: dict[str, str], audio: bytes, fmt: str
) -> tuple[bytes, bytes]:
    """The ``content-type`` header value and the body of a transcription request.

    Args:
        boundary: the part separator (must not occur in the audio: a random token).
        fields: the form fields (``model``, ``response_format``...).
        audio: the file's bytes, sent as ``audio.<fmt>``.
    """
    b = boundary.encode("ascii")
    out = bytearray()
    for name, value in fields.items():
        out += b"--" + b + b"\r\n"
        out += b'Content-Disposition: form-data; name="%s"\r\n\r\n' % name.encode()
        out += value.encode("utf-8") + b"\r\n"
    mime = AUDIO_TYPES.get(fmt, "application/octet-stream").encode()
    out += b"--" + b + b"\r\n"
    out += b'Content-Disposition: form-data; name="file"; filename="audio.%s"\r\n' % fmt.encode()
    out += b"Content-Type: " + mime + b"\r\n\r\n"
    out += audio + b"\r\n--" + b + b"--\r\n"
    return b"multipart/form-data; boundary=" + b, bytes(out)


def read_transcript(body: bytes) -> str:
    """The ``text`` of a transcription answer.

    Raises:
        msgspec.DecodeError: the answer is not ``{"text": "..."}``.
    """
    return _transcript.decode(body).text
