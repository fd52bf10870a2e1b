"""The Chrome trace-event shape, checked without a browser (the object form of the JSON)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def check_trace_events(doc: Mapping[str, Any]) -> list[str]:
    """Problems with ``doc`` as trace-event JSON (object form); empty when it is well-formed.

    The shape Perfetto's and ``chrome://tracing``'s JSON importers need: a
    ``traceEvents`` list of objects with a string ``name``, a known ``ph``, integer
    ``pid``/``tid``, a numeric ``ts`` (not on metadata), a non-negative ``dur`` on
    complete events, a scope on instants, and ``args`` an object where present.
    """
    problems: list[str] = []
    events = doc.get("traceEvents")
    if not isinstance(events, Sequence) or isinstance(events, str | bytes):
        return ["`traceEvents` is not a list"]
    for i, ev in enumerate(events):
        where = f"traceEvents[{i}]"
        if not isinstance(ev, Mapping):
            problems.append(f"{where} is not an object")
            continue
        ph = ev.get("ph")
        if ph not in ("B", "E", "X", "i", "I", "M", "C"):
            problems.append(f"{where}: unknown ph {ph!r}")
        if not isinstance(ev.get("name"), str):
            problems.append(f"{where}: name is not a string")
        for k in ("pid", "tid"):
            if not isinstance(ev.get(k), int) or isinstance(ev.get(k), bool):
                problems.append(f"{where}: {k} is not an integer")
        if ph != "M" and not isinstance(ev.get("ts"), int | float):
            problems.append(f"{where}: ts is not a number")
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, int | float) or dur < 0:
                problems.append(f"{where}: dur is not a non-negative number")
        if ph in ("i", "I") and ev.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where}: instant scope {ev.get('s')!r}")
        if "args" in ev and not isinstance(ev["args"], Mapping):
            problems.append(f"{where}: args is not an object")
        elif "args" in ev:
            for k in ("runnable_us", "blocked_us"):
                if k in ev["args"] and not ev["args"][k] >= 0:
                    problems.append(f"{where}: {k} is negative")
    return problems
