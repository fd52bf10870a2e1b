"""The ASGI lifespan: open the gateway at ``lifespan.startup``, close it at
``lifespan.shutdown``.

What opens and closes, and in which order, is :func:`.gateway.opened`'s; this
module speaks the protocol and says why a start failed: under the hypercorn
binary in one line on stderr and a non-zero exit status (:mod:`.startup`),
elsewhere with ``lifespan.startup.failed``.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

from .. import server
from .gateway import opened
from .startup import hypercorn_process, refuse_to_start, show_startup_logs

if TYPE_CHECKING:
    from ..http.types import Receive, Send
    from .gateway import Gateway

log = logging.getLogger("aiserve_trio")


async def lifespan(gateway: Gateway, receive: Receive, send: Send) -> None:
    """Run the ASGI lifespan of ``gateway``."""
    # hypercorn's lifespan hands its own receive: its config is the server's.
    server_config = server.server_config(receive)
    await receive()  # lifespan.startup
    show_startup_logs()
    async with AsyncExitStack() as stack:
        try:
            # Whatever was opened before a part failed is closed again on the way out.
            await stack.enter_async_context(opened(gateway, server_config))
        except Exception as exc:
            if (role := hypercorn_process()) is not None:
                # Under the hypercorn binary a failed lifespan ends the worker with
                # a traceback and the server with status 0 (startup.py): whatever
                # stops the start -- a database migrated by a newer gateway, a port
                # an adapter cannot open -- is one line and a non-zero exit, as a
                # bad config is. The traceback is there at debug level.
                log.debug("start-up failed", exc_info=True)
                refuse_to_start(start_failure(gateway, exc), role)
            log.exception("start-up failed")
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
    await send({"type": "lifespan.shutdown.complete"})


def start_failure(gateway: Gateway, exc: Exception) -> str:
    """What stopped the start, in one line that names the config file."""
    said = str(exc)
    source = str(gateway.config.source)
    if said.startswith(source):  # a ConfigError names the file and the key itself
        return said
    return f"{source}: start-up failed: {type(exc).__name__}: {said}"
