"""hypercorn's ``Date`` header, formatted once a second instead of once a response.

hypercorn 0.18 formats the header for every response (``Config.response_headers``
calls ``wsgiref.handlers.format_date_time(time())``: a ``gmtime`` and a string
format each time), though its value only changes once a second. :func:`install`
gives hypercorn's config module a ``format_date_time`` that keeps the last
second's text: the same header, byte for byte. Importing this module changes
nothing; installing twice is harmless.
"""

from __future__ import annotations

from collections.abc import Callable

from .hypercorn_version import Patch


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


def _apply() -> None:
    """Make hypercorn format its ``Date`` header once a second (see :data:`install`)."""
    from hypercorn import config

    config.format_date_time = cached(config.format_date_time)  # type: ignore[attr-defined,assignment]


install = Patch(_apply)
