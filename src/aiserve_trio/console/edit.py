"""Reorder a route's steps and switch them on or off in the config file's own text (pure).

The console writes its changes back into the TOML file the gateway was started with,
not into a second file: the file stays the one place that says what runs, and a
``git diff`` of it shows the change. :func:`set_steps` edits the text with tomlkit,
which keeps every comment, blank line and the formatting of the lines it does not
touch; only the route's ``[[routes.steps]]`` tables move and only their ``enabled``
lines change (a step switched off without an ``enabled`` line gets one).

Comments move with the step they touch: those directly above a step's header and those
directly below its last line go where the step goes. A comment with a blank line on
both sides stays where it was, as do the comments directly above whatever follows the
last step (another route, a table of the route).

Every edit is checked before it is returned: the new text must parse to exactly the old
document with the route's steps in the new order and the new ``enabled`` values, and
must hold the same lines as the old one but for ``enabled`` lines and blank lines. An
edit that would do anything else is refused (:class:`EditError`), never written.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import AoT, Comment, Item, Key, SingleKey, Table, Whitespace

Body = list[tuple[Key | None, Item]]


class EditError(ValueError):
    """The edit cannot be made; the message says why, for an operator."""

    def __init__(self, message: str, *, code: str = "invalid_steps") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class StepState:
    """One step as the console shows it and sends it back."""

    name: str
    enabled: bool
    kind: str = ""


def read_steps(text: str, path: str) -> list[StepState]:
    """The steps of the route at ``path`` as ``text`` writes them.

    Raises:
        EditError: ``text`` is not TOML, or no route has that path.
    """
    doc = _load(text)
    route = _route_dict(doc, path)
    return [
        StepState(_name(s), bool(s.get("enabled", True)), str(s.get("kind", "")))
        for s in route.get("steps", [])
    ]


def _name(step: Any) -> str:
    """A step's name: its ``name``, or its ``kind`` when it has none (as the config reads it)."""
    return str(step.get("name") or step.get("kind") or "")


def set_steps(text: str, path: str, steps: Sequence[StepState]) -> str:
    """``text`` with the route at ``path`` running ``steps`` in their order.

    Args:
        steps: every step of the route, each once, by name, in the new order,
            with its new ``enabled`` (``kind`` is ignored).

    Raises:
        EditError: not TOML; no such route; ``steps`` is not the route's steps
            exactly once each; the steps are not written as ``[[routes.steps]]``
            tables; or the edit could not be made without changing anything else.
    """
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        why = f"the config file is not valid TOML: {exc}"
        raise EditError(why, code="invalid_config") from None
    table = _route_table(doc, path)
    aot = table.get("steps")
    if aot is None:
        raise EditError(f"route {path} has no steps", code="no_steps")
    if not isinstance(aot, AoT):
        raise EditError(
            f"route {path} writes its steps as an inline array; the console edits steps "
            "written as [[routes.steps]] tables",
            code="steps_not_editable",
        )
    tables: list[Table] = list(aot.body)
    names = [_name(t) for t in tables]
    order = _order(path, names, steps)
    for position, i in enumerate(order):
        _set_enabled(tables[i], steps[position].enabled)
    _move(table, aot, tables, order)
    out = doc.as_string()
    _check(text, out, path, steps)
    return out


def _load(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        why = f"the config file is not valid TOML: {exc}"
        raise EditError(why, code="invalid_config") from None


def _route_dict(doc: dict[str, Any], path: str) -> dict[str, Any]:
    for route in doc.get("routes", []):
        if isinstance(route, dict) and route.get("path") == path:
            return route
    raise EditError(f"the config file has no route with path {path}", code="route_not_found")


def _route_table(doc: tomlkit.TOMLDocument, path: str) -> Table:
    routes = doc.get("routes")
    if isinstance(routes, AoT):
        for table in routes.body:
            if table.get("path") == path:
                return table
    raise EditError(f"the config file has no route with path {path}", code="route_not_found")


def _order(path: str, names: list[str], steps: Sequence[StepState]) -> list[int]:
    """Indices into ``names`` in the new order."""
    wanted = [s.name for s in steps]
    seen: set[str] = set()
    for name in wanted:
        if name in seen:
            raise EditError(f"step {name!r} is named twice")
        seen.add(name)
        if name not in names:
            raise EditError(f"route {path} has no step {name!r}", code="unknown_step")
    missing = [n for n in names if n not in seen]
    if missing:
        raise EditError(
            f"the new order must name every step of route {path}; missing: {', '.join(missing)}"
        )
    if len(set(names)) != len(names):
        raise EditError(f"route {path} names a step twice in the config file")
    return [names.index(n) for n in wanted]


def _set_enabled(table: Table, enabled: bool) -> None:
    current = table.get("enabled")
    if current is None:
        if enabled:
            return  # a step without the key is enabled
        body = table.value.body
        # After the step's last key, before its sub-tables and trailing comments.
        keys = [i for i, (k, v) in enumerate(body) if k is not None and not _is_table(v)]
        at = keys[-1] + 1 if keys else 0
        indent = body[keys[0]][1].trivia.indent if keys else ""
        value = tomlkit.item(False)
        value.trivia.indent = indent
        body.insert(at, (SingleKey("enabled"), value))
    elif bool(current) != enabled:
        table["enabled"] = enabled  # tomlkit keeps the line's comment


def _is_table(item: Item) -> bool:
    return isinstance(item, (Table, AoT))


def _trivia(item: Item) -> bool:
    return isinstance(item, (Comment, Whitespace))


def _last_body(body: Body) -> Body:
    """The body whose end is rendered last: sub-tables are written after a table's keys."""
    while body:
        last = body[-1][1]
        if isinstance(last, Table):
            body = last.value.body
        elif isinstance(last, AoT) and last.body:
            body = last.body[-1].value.body
        else:
            break
    return body


@dataclass
class _Tail:
    """The trivia at the end of one step table: comments touching it, the separator,
    and the comments directly above the next header."""

    own: Body
    sep: Body
    lead: Body


def _split(body: Body) -> _Tail:
    start = len(body)
    while start > 0 and body[start - 1][0] is None and _trivia(body[start - 1][1]):
        start -= 1
    tail = body[start:]
    del body[start:]
    blanks = [i for i, (_, item) in enumerate(tail) if isinstance(item, Whitespace)]
    if not blanks:
        return _Tail([], [], tail)
    return _Tail(tail[: blanks[0]], tail[blanks[0] : blanks[-1] + 1], tail[blanks[-1] + 1 :])


def _lead_before(route: Table, aot: AoT) -> tuple[Body, int]:
    """The body holding the comments directly above the first step's header, and where
    those comments start in it (they run to the end of it, or to the steps)."""
    body = route.value.body
    at = next(i for i, (_, item) in enumerate(body) if item is aot)
    if at > 0 and _is_table(body[at - 1][1]):
        body = _last_body([body[at - 1]])
        at = len(body)
    start = at
    while start > 0 and body[start - 1][0] is None and isinstance(body[start - 1][1], Comment):
        start -= 1
    return body, start


def _move(route: Table, aot: AoT, tables: list[Table], order: list[int]) -> None:
    n = len(tables)
    bodies = [_last_body(t.value.body) for t in tables]
    tails = [_split(b) for b in bodies]
    first, start = _lead_before(route, aot)
    end = start
    while end < len(first) and first[end][0] is None and isinstance(first[end][1], Comment):
        end += 1
    # leads[i]: the comments directly above step i's header; leads[n]: above what follows.
    leads = [first[start:end]] + [t.lead for t in tails]
    first[start:end] = leads[order[0]]
    for j, i in enumerate(order):
        following = leads[order[j + 1]] if j + 1 < n else leads[n]
        bodies[i].extend([*tails[i].own, *tails[j].sep, *following])
    aot.body[:] = [tables[i] for i in order]


def _check(before: str, after: str, path: str, steps: Sequence[StepState]) -> None:
    """Refuse an edit that changed more than the steps' order and ``enabled`` values."""
    old, new = _load(before), _load(after)
    want = _route_dict(old, path)  # edited in place: ``old`` becomes the expected document
    by_name = {_name(s): s for s in want.get("steps", [])}
    moved = []
    for step in steps:
        s = dict(by_name[step.name])
        if "enabled" in s or not step.enabled:
            s["enabled"] = step.enabled
        moved.append(s)
    want["steps"] = moved
    lines_before = Counter(line.strip() for line in before.splitlines())
    lines_after = Counter(line.strip() for line in after.splitlines())
    changed = (lines_before - lines_after) + (lines_after - lines_before)
    stray = [line for line in changed if line and not line.startswith("enabled")]
    if new != old or stray:
        raise EditError(
            f"the steps of route {path} could not be rewritten without changing other "
            "lines of the config file; edit the file by hand",
            code="edit_failed",
        )
