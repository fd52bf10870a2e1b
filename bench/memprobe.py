"""Where per-stream memory goes: the gateway app under tracemalloc (bench only).

``hypercorn ... bench.memprobe:app`` serves ``aiserve_trio:app`` with tracemalloc on.
The first SIGUSR1 takes a baseline snapshot; each later one writes the growth since
the baseline, grouped by file and by line, to ``$MEMPROBE_OUT``.
"""

from __future__ import annotations

import os
import signal
import tracemalloc
from types import FrameType

if os.environ.get("MEMPROBE_FRAMES", "1") != "0":
    tracemalloc.start(int(os.environ.get("MEMPROBE_FRAMES", "1")))

from aiserve_trio import app

_base: list[tracemalloc.Snapshot] = []
_types: list[object] = []


def _dump(signum: int, frame: FrameType | None) -> None:
    if not tracemalloc.is_tracing():
        return
    snap = tracemalloc.take_snapshot()
    if not _base:
        _base.append(snap)
        return
    out = os.environ.get("MEMPROBE_OUT", "bench/work/memprobe.txt")
    with open(out, "w") as f:
        for key in ("filename", "lineno", "traceback"):
            stats = snap.compare_to(_base[0], key)
            total = sum(s.size_diff for s in stats)
            f.write(f"== by {key}: total growth {total / 1e6:.1f} MB\n")
            for s in stats[:40]:
                f.write(f"{s.size_diff / 1e3:10.0f} KB {s.count_diff:8d}  ")
                f.write("\n    ".join(str(fr) for fr in s.traceback.format()[-24:]) if key == "traceback"
                        else str(s.traceback[0]))
                f.write("\n")


def _collect(signum: int, frame: FrameType | None) -> None:
    import gc
    import sys

    def rss() -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) // 1024

    from collections import Counter

    before = rss()
    found = gc.collect()
    hist = Counter(type(o).__qualname__ + " " + type(o).__module__ for o in gc.get_objects())
    if not _types:
        _types.append(hist)
    else:
        hist.subtract(_types[0])
        for name, n in hist.most_common(45):
            print(f"memprobe: {n:8d} {name}", file=sys.stderr)
        excs = [o for o in gc.get_objects() if isinstance(o, BaseException)]
        print(f"memprobe: exceptions alive: {Counter(type(e).__name__ for e in excs)}", file=sys.stderr)
        for e in excs[-3:]:
            tb = e.__traceback__
            where = []
            while tb is not None:
                where.append(f"{tb.tb_frame.f_code.co_filename.rsplit('/', 2)[-1]}:{tb.tb_lineno}")
                tb = tb.tb_next
            refs = [type(r).__name__ for r in gc.get_referrers(e)]
            print(f"memprobe: {type(e).__name__} {str(e)[:60]!r} tb={where} held by {refs}", file=sys.stderr)
    print(f"memprobe: gc.collect() found {found} objects; RSS {before} -> {rss()} MB;"
          f" {len(gc.get_objects())} tracked objects", file=sys.stderr, flush=True)


signal.signal(signal.SIGUSR1, _dump)
signal.signal(signal.SIGUSR2, _collect)

__all__ = ["app"]
