"""aiserve-trio: a Trio-based streaming AI gateway speaking the OpenAI Chat Completions API.

Serve it with hypercorn's Trio worker::

    hypercorn --config configs/hypercorn.toml aiserve_trio:app

``app`` is built on first access from ``$AISERVE_CONFIG`` or the embedded
default config; a bad config raises :class:`ConfigError` there, so the server
does not start: under the hypercorn binary it says so in one line on stderr
and exits non-zero (:mod:`.startup`).

Importing the package is cheap: it imports none of the gateway. ``App``,
``create_app``, ``Config``, ``load_config`` and ``__version__`` are looked up on
first use, and ``app`` builds the gateway on its first ASGI call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.errors import ConfigError

if TYPE_CHECKING:
    from .config import Config, load_config
    from .runtime.asgi import App, create_app

__all__ = ["App", "Config", "ConfigError", "__version__", "app", "create_app", "load_config"]

#: What the package names, and the module each comes from (imported on first use).
_LAZY = {
    "App": "runtime.asgi",
    "create_app": "runtime.asgi",
    "Config": "config",
    "load_config": "config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    elif name in ("__version__", "version"):
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            value = dist_version("aiserve-trio")
        except PackageNotFoundError:  # running from a source tree
            value = "0.0.0"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


class _DeferredApp:
    """The ASGI app hypercorn imports as ``aiserve_trio:app``.

    The config is loaded and the gateway built on the first ASGI call (lifespan
    start-up), not at import, so importing the package has no side effects. A bad
    config fails start-up: in a hypercorn process, with one line on stderr and a
    non-zero exit status of the hypercorn binary (see :mod:`.startup` for why the
    ASGI way, ``lifespan.startup.failed``, gives neither there); elsewhere with
    ``lifespan.startup.failed`` and the ConfigError's message.
    """

    def __init__(self) -> None:
        self._app: App | None = None

    def get(self) -> App:
        if self._app is None:
            from .runtime.asgi import create_app

            self._app = create_app()
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None and scope["type"] == "lifespan":
            try:
                self.get()
            except ConfigError as exc:
                from .runtime.startup import hypercorn_process, refuse_to_start

                role = hypercorn_process()
                if role is not None:
                    refuse_to_start(str(exc), role)
                await receive()
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        await self.get()(scope, receive, send)


app = _DeferredApp()
