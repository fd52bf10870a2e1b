"""hypercorn's ``Date`` header, formatted once a second instead of once a response.

hypercorn 0.18 formats the header for every response (``Config.response_headers``
calls ``wsgiref.handlers.format_date_time(time())``: a ``gmtime`` and a string
format each time), though its value only changes once a second. The seam's config
view (``worker.py``) uses :func:`cached`: the same header, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable


def cached(format_date_time: Callable[[float], str]) -> Callable[[float], str]:
    """``format_date_time`` that formats each whole second once (the header has no finer part)."""
    last_second: int | None = None
    last_text = ""

    def format_cached(timestamp: float) -> str:
        nonlocal last_second, last_text
        second = int(timestamp)
        if second != last_second:
            last_text = format_date_time(second)
            last_second = second
        return last_text

    return format_cached
