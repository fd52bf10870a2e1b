"""What the app learns from the ``receive`` hypercorn hands it: the server's config at
start-up, and the messages already queued for a request.

Both read the object behind a bound method (``receive.__self__``): hypercorn's lifespan
calls the app with its own ``Lifespan.asgi_receive`` (the config it was made with is its
``config``), and hypercorn's Trio worker calls it with its queue's ``receive``, a Trio
memory channel's (``TaskGroup.spawn_app``; both pinned, ``fingerprints.py``). With the
seam and with hypercorn as shipped alike; from any other server, None.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

#: An ASGI message (``http.types.Message``).
Message = MutableMapping[str, Any]


def server_config(receive: Callable[..., Any]) -> object | None:
    """hypercorn's config, when ``receive`` is its lifespan's (the app's start-up); None
    from any other server."""
    return getattr(getattr(receive, "__self__", None), "config", None)


def queued(receive: Callable[[], Awaitable[Message]]) -> Message | None:
    """The message the server has already queued for ``receive``, if it can tell: taken
    without a checkpoint or a cancel scope. None: nothing queued, or not hypercorn's
    Trio worker (a ``receive`` that is not a Trio memory channel's)."""
    channel = getattr(receive, "__self__", None)
    if not isinstance(channel, trio.MemoryReceiveChannel):
        return None
    try:
        message: Message = channel.receive_nowait()
    except trio.WouldBlock:
        return None
    return message
