"""Open files for a worker's streams: the soft ``RLIMIT_NOFILE`` raised to what the limits need.

Every stream a worker holds is one client socket and, to an HTTP backend, one
upstream socket. Debian's default soft limit is 1,024 descriptors (the hard limit is
far higher), so a worker allowed ``max_inflight = 4096`` would fail to accept at
about 500 streams, long before its memory (about 125 KB a held stream) ran out.

:func:`needed` is the rule (pure): two descriptors per in-flight request and a
margin for the listening sockets, Redis, log files and the like. :func:`raise_soft`
raises the soft limit towards it, never above the hard limit and never down, and
says what it did, for the start-up log. Only in a process of the hypercorn binary,
like :mod:`.gctune`.
"""

from __future__ import annotations

import resource
from typing import Final

#: Descriptors beyond the streams': listening sockets, Redis, files, the event loop's own.
MARGIN: Final = 256


def needed(max_inflight: int) -> int:
    """Descriptors a worker needs to hold ``max_inflight`` requests to HTTP backends."""
    return 2 * max_inflight + MARGIN


def plan(soft: int, hard: int, want: int) -> int:
    """The soft limit to set: ``want`` where the hard limit allows, never lower than now."""
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    return max(soft, want)


def raise_soft(max_inflight: int) -> tuple[str, bool]:
    """Raise the soft open-file limit for ``max_inflight``; (what was done, whether enough)."""
    want = needed(max_inflight)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = plan(soft, hard, want)
    if new != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as exc:
            return f"open files: soft limit {soft} kept ({exc}); {want} needed", False
    said = f"open files: soft limit {soft}" + (f" -> {new}" if new != soft else "")
    if new < want:
        return (
            f"{said}, below the {want} that [limits] max_inflight = {max_inflight} needs "
            f"(hard limit {hard}): raise it (ulimit -Hn, LimitNOFILE=) or lower max_inflight",
            False,
        )
    return f"{said} (max_inflight {max_inflight} needs {want})", True
