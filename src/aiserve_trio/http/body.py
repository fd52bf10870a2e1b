"""Reading a whole request body through ASGI ``receive``, with a size cap."""

from __future__ import annotations

from ..core.errors import PayloadTooLarge
from .types import Receive


async def read_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The body, or None when the client went away before sending it all.

    The caller bounds the time (a cancel scope); this bounds the size, refusing
    the body once it passes ``max_bytes`` rather than after buffering it all.

    Raises:
        PayloadTooLarge: the body is larger than ``max_bytes``.
    """
    body = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body += msg.get("body", b"")
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
        if not msg.get("more_body", False):
            return bytes(body)
