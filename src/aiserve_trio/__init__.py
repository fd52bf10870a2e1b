"""aiserve-trio: a Trio-based streaming AI gateway speaking the OpenAI Chat Completions API.

Serve it with hypercorn's Trio worker::

    hypercorn --config configs/hypercorn.toml aiserve_trio:app

``app`` is built on first access from ``$AISERVE_CONFIG`` or the embedded
default config; a bad config raises :class:`ConfigError` there, so the server
does not start: under the hypercorn binary it says so in one line on stderr
and exits non-zero (:mod:`.startup`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import Any

from .asgi import App, create_app
from .config import Config, load_config
from .errors import ConfigError
from .startup import hypercorn_process, refuse_to_start

try:
    __version__ = _version("aiserve-trio")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

version = __version__

__all__ = ["App", "Config", "ConfigError", "__version__", "app", "create_app", "load_config"]


class _DeferredApp:
    """The ASGI app hypercorn imports as ``aiserve_trio:app``.

    The config is loaded on the first ASGI call (lifespan start-up), not at
    import, so importing the package has no side effects. A bad config fails
    start-up: in a hypercorn process, with one line on stderr and a non-zero
    exit status of the hypercorn binary (see :mod:`.startup` for why the ASGI
    way, ``lifespan.startup.failed``, gives neither there); elsewhere with
    ``lifespan.startup.failed`` and the ConfigError's message.
    """

    def __init__(self) -> None:
        self._app: App | None = None

    def get(self) -> App:
        if self._app is None:
            self._app = create_app()
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None and scope["type"] == "lifespan":
            try:
                self.get()
            except ConfigError as exc:
                role = hypercorn_process()
                if role is not None:
                    refuse_to_start(str(exc), role)
                await receive()
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        await self.get()(scope, receive, send)


app = _DeferredApp()
