"""A deterministic JSON Schema instance generator (pure).

The sim answers structured-output requests (``response_format`` with a
``json_schema``) and tool calls (a function's ``parameters``) with JSON that
must validate against the schema the client sent, so that an SDK's parser
(``Model.model_validate_json``, ``json.loads`` + the function's schema) accepts
it. Always the same instance for the same schema, so tests can compare it.

Covered: ``type`` (one or a list: the first is used), objects (all
``required`` properties, every property when ``strict``; nothing beyond
``properties``, so ``additionalProperties: false`` holds), strings (``format``
date-time / date / time / email / uri / uuid, ``minLength`` / ``maxLength``),
numbers and integers (``minimum`` / ``maximum``, exclusive bounds,
``multipleOf``), booleans, null, arrays (``minItems`` items, one when there is
no minimum; ``prefixItems``; ``maxItems``), ``enum`` (the first value),
``const``, ``$ref`` into ``$defs`` / ``definitions``, ``anyOf`` / ``oneOf``
(the first branch), ``allOf`` (merged), and recursive models (past a depth,
arrays stay at ``minItems``, optional properties are left out and a nullable
choice takes ``null``). Not covered: ``pattern`` and ``uniqueItems`` with
more than one item (the sim does not try to satisfy them).
"""

from __future__ import annotations

import math
from typing import Any

Schema = dict[str, Any]

#: Beyond this nesting the generator takes the smallest instance a schema allows,
#: so a recursive model (a tree of nodes) ends.
_SHALLOW = 4
#: A schema that still nests this deep has no finite instance (a required cycle).
_MAX_DEPTH = 64

_FORMATS = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00Z",
    "email": "sim@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "duration": "P1D",
}


class SchemaError(ValueError):
    """The schema is not one the generator can give an instance of."""


def instance(schema: Schema, *, strict: bool = False) -> Any:
    """A JSON value (dicts, lists, str, int, float, bool, None) valid against ``schema``.

    Args:
        schema: the JSON Schema; ``$ref`` pointers resolve against it.
        strict: include every property of every object, not only the required
            ones (OpenAI's strict mode requires them all anyway).

    Raises:
        SchemaError: a ``$ref`` that does not resolve, or a required cycle.
    """
    return _Gen(schema, strict).value(schema, 0)


class _Gen:
    __slots__ = ("root", "strict")

    def __init__(self, root: Schema, strict: bool) -> None:
        self.root = root
        self.strict = strict

    def value(self, s: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise SchemaError("the schema nests without end (a required cycle?)")
        if not isinstance(s, dict):
            # `true` / `false` schemas, or garbage: anything is as good as null.
            return None
        if "$ref" in s:
            return self.value(self._merge(self._resolve(s["$ref"]), s, "$ref"), depth + 1)
        if "const" in s:
            return s["const"]
        if s.get("enum"):
            return s["enum"][0]
        if "allOf" in s:
            merged: Schema = {k: v for k, v in s.items() if k != "allOf"}
            for part in s["allOf"]:
                merged = _merge_objects(merged, self._deref(part))
            return self.value(merged, depth + 1)
        for key in ("anyOf", "oneOf"):
            if s.get(key):
                return self.value(self._branch(s, key, depth), depth + 1)
        kind = _type_of(s, shallow=depth <= _SHALLOW)
        if kind == "object":
            return self._object(s, depth)
        if kind == "array":
            return self._array(s, depth)
        if kind == "string":
            return _string(s)
        if kind == "integer":
            return _number(s, integer=True)
        if kind == "number":
            return _number(s, integer=False)
        if kind == "boolean":
            return True
        return None

    def _resolve(self, ref: str) -> Schema:
        if not ref.startswith("#"):
            raise SchemaError(f"only local $ref pointers are supported, got {ref!r}")
        node: Any = self.root
        for raw in ref[1:].split("/")[1:]:
            key = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or key not in node:
                raise SchemaError(f"$ref {ref!r} does not resolve")
            node = node[key]
        if not isinstance(node, dict):
            raise SchemaError(f"$ref {ref!r} is not a schema")
        return node

    def _deref(self, s: Any) -> Any:
        while isinstance(s, dict) and "$ref" in s:
            s = self._merge(self._resolve(s["$ref"]), s, "$ref")
        return s

    @staticmethod
    def _merge(target: Schema, site: Schema, drop: str) -> Schema:
        # Keywords beside a $ref (a description, a default) do not change the
        # instance; the target's constraints are what must hold.
        extra = {k: v for k, v in site.items() if k not in (drop, "description", "title")}
        return {**target, **extra} if extra else target

    def _branch(self, s: Schema, key: str, depth: int) -> Any:
        branches = s[key]
        if depth > _SHALLOW:
            # Deep in a recursive model: take null if the choice allows it, so it ends.
            for b in branches:
                if isinstance(b, dict) and _type_of(self._deref(b), shallow=False) == "null":
                    return b
        rest = {k: v for k, v in s.items() if k != key}
        first = branches[0]
        return _merge_objects(rest, first) if rest and isinstance(first, dict) else first

    def _object(self, s: Schema, depth: int) -> dict[str, Any]:
        props: dict[str, Any] = s.get("properties") or {}
        required = set(s.get("required") or ())
        out: dict[str, Any] = {}
        for name, sub in props.items():
            # Optional properties only near the top: deep down they could recurse.
            if name in required or (self.strict and depth <= _SHALLOW):
                out[name] = self.value(sub, depth + 1)
        for name in required - out.keys():
            # Required but not described: any value will do unless extras are banned.
            if s.get("additionalProperties") is not False:
                extra = s.get("additionalProperties")
                out[name] = self.value(extra, depth + 1) if isinstance(extra, dict) else "sim"
        return out

    def _array(self, s: Schema, depth: int) -> list[Any]:
        prefix = s.get("prefixItems") or []
        lo = int(s.get("minItems", 0))
        hi = s.get("maxItems")
        items = s.get("items")
        if isinstance(items, list):  # draft-04 tuple form
            prefix, items = items, s.get("additionalItems")
        n = max(lo, len(prefix), 1 if depth <= _SHALLOW else 0)
        if hi is not None:
            n = min(n, int(hi))
        if items is False or (items is None and prefix):
            n = min(n, len(prefix))
        out = [self.value(p, depth + 1) for p in prefix[:n]]
        out += [self.value(items or {}, depth + 1) for _ in range(n - len(out))]
        return out


def _type_of(s: Schema, *, shallow: bool) -> str | None:
    t = s.get("type")
    if isinstance(t, list):
        types = [x for x in t if isinstance(x, str)]
        if not types:
            return None
        if not shallow and "null" in types:
            return "null"
        return types[0]
    if isinstance(t, str):
        return t
    if "properties" in s or "required" in s or "additionalProperties" in s:
        return "object"
    if "items" in s or "prefixItems" in s:
        return "array"
    return None


def _merge_objects(a: Schema, b: Any) -> Schema:
    """``allOf`` of two schemas, shallowly: properties and required lists are united."""
    if not isinstance(b, dict):
        return a
    out = {**a, **b}
    if "properties" in a and "properties" in b:
        out["properties"] = {**a["properties"], **b["properties"]}
    if "required" in a and "required" in b:
        out["required"] = [*a["required"], *(r for r in b["required"] if r not in a["required"])]
    return out


def _string(s: Schema) -> str:
    text = _FORMATS.get(str(s.get("format", "")), "sim")
    lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
    if len(text) < lo:
        text += "x" * (lo - len(text))
    if hi is not None and len(text) > int(hi):
        text = text[: int(hi)]
    return text


def _number(s: Schema, *, integer: bool) -> int | float:
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    # Draft-04 spells exclusive bounds as booleans beside minimum / maximum.
    if xlo is True:
        xlo, lo = lo, None
    if xhi is True:
        xhi, hi = hi, None
    bmin, bmax, xmin, xmax = (_bound(b) for b in (lo, hi, xlo, xhi))
    mult = _bound(s.get("multipleOf"))
    if mult is not None and mult <= 0:
        mult = None

    def fits(v: float) -> bool:
        return (
            (bmin is None or v >= bmin)
            and (bmax is None or v <= bmax)
            and (xmin is None or v > xmin)
            and (xmax is None or v < xmax)
            and (mult is None or abs(v / mult - round(v / mult)) < 1e-9)
            and (not integer or float(v).is_integer())
        )

    # Candidates, most natural first: 1, 0, then values next to each bound.
    candidates: list[float] = [1, 0]
    bounds = [b for b in (bmin, xmin, bmax, xmax) if b is not None]
    for b in bounds:
        if mult is not None:
            candidates += [(math.floor(b / mult) + k) * mult for k in (0, 1, -1, 2)]
        else:
            candidates += [b, math.floor(b) + 1, math.ceil(b) - 1, b + 0.5, b - 0.5]
    if len(bounds) >= 2:
        candidates.append((min(bounds) + max(bounds)) / 2)
    for c in candidates:
        if fits(c):
            return int(c) if integer else float(c)
    raise SchemaError(f"no {'integer' if integer else 'number'} fits {s!r}")


def _bound(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None
