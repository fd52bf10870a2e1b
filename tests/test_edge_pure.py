"""The edge guard's rules (``security/edge.py``) are what their docstring says: pure
counters with a clock argument -- no I/O, no clock of their own, no state kept in the
module, nothing of hypercorn's (issue 45, item 5). The seam (``server/``) owns the
worker's objects and hands them the time."""

from __future__ import annotations

import ast

from .test_architecture import PKG, module_state

EDGE = PKG / "security" / "edge.py"

#: What the rules may import: the standard library's pure parts, and h2's event classes
#: (they read the events h2 made of a read; they never drive a connection).
PURE = frozenset(
    {
        "__future__",
        "collections",
        "collections.abc",
        "dataclasses",
        "ipaddress",
        "math",
        "typing",
        "h2.events",
    }
)

#: Names whose call does I/O or reads a clock.
IMPURE_CALLS = frozenset({"open", "print", "input"})
IMPURE_ATTRS = frozenset({"time", "monotonic", "perf_counter", "current_time", "sleep"})


def impurities(source: str) -> list[str]:
    """What in ``source`` is not pure: imports outside :data:`PURE`, I/O builtins, clock
    reads; and module-level state (``test_architecture.module_state``)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: imports {a.name}" for a in node.names if a.name not in PURE]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module not in PURE:
                found.append(f"{line}: imports from {module}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in IMPURE_CALLS:
                found.append(f"{line}: calls {f.id}")
            if isinstance(f, ast.Attribute) and f.attr in IMPURE_ATTRS:
                found.append(f"{line}: calls .{f.attr}")
    found += [s.split(":", 1)[1] for s in module_state(tree, "edge")]
    return found


def test_the_checker_finds_what_is_not_pure() -> None:
    source = (
        "import time\n"
        "import dataclasses\n"
        "from ..server import worker\n"
        "_box = {}\n"
        "def f(now):\n"
        "    _box[now] = open('x')\n"
        "    return time.monotonic()\n"
    )
    assert impurities(source) == [
        "1: imports time",
        "3: imports from ..server",
        "6: calls open",
        "7: calls .monotonic",
        "6 changes _box, kept at module level",
    ]


def test_the_edge_rules_are_pure() -> None:
    assert impurities(EDGE.read_text()) == []
