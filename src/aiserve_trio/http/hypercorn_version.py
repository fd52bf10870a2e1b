"""The hypercorn versions whose internals the app's patches were written against.

The guard (``security/edge.py``), the write coalescing (``http/coalesce.py``), the
direct reads and writes (``http/directio.py``), the keep-alive timer (``http/idle.py``), the
``Date`` header (``http/datecache.py``) and the disconnect call (``http/disconnect.py``) each
replace a piece of hypercorn's internals; each
installs only when :func:`refusal` finds the installed hypercorn is one of
:data:`SUPPORTED`, and says why not otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

#: hypercorn versions (major, minor) whose internals the patches were written against.
SUPPORTED = ((0, 18),)


def supported(version: str) -> bool:
    """Whether the patches were written for hypercorn ``version``."""
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) in SUPPORTED
    except (IndexError, ValueError):
        return False


def refusal() -> str | None:
    """Why a patch must not be installed on this hypercorn (for the start-up log), or None."""
    try:
        hv = dist_version("hypercorn")
    except PackageNotFoundError:
        return "not installed: hypercorn is not installed"
    if not supported(hv):
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        return f"not installed: hypercorn {hv} is not a version it was written for ({known})"
    return None


class Patch:
    """One of the app's patches of hypercorn: ``install()`` applies it at most once, and only
    to a hypercorn of :data:`SUPPORTED`.

    Calling it returns what was done, for the start-up log: ``installed``, ``already
    installed``, or ``not installed: ...`` (hypercorn missing, or a version the patch does
    not know). ``installed`` says whether it has been applied (tests reset it).
    """

    __slots__ = ("_apply", "installed")

    def __init__(self, apply: Callable[[], str | None]) -> None:
        """``apply`` patches hypercorn; it may return what to say instead of ``installed``."""
        self._apply = apply
        self.installed = False

    def __call__(self) -> str:
        if self.installed:
            return "already installed"
        if (why := refusal()) is not None:
            return why
        self.installed = True
        return self._apply() or "installed"
