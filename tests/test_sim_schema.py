"""aiserve-sim's JSON Schema instance generator: pydantic models accept what it makes,
and a small independent validator agrees on hand-written and random schemas."""

from __future__ import annotations

import datetime
import enum
import json
import math
import uuid
from typing import Annotated, Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from aiserve_trio.sim.schema import SchemaError, instance

# --- a validator, written from the spec's side (used by the other sim tests too) ---


def schema_errors(schema: Any, value: Any, root: Any = None) -> list[str]:
    """Why ``value`` does not validate against ``schema`` (empty: it does)."""
    root = schema if root is None else root
    if schema is True or schema is None:
        return []
    if schema is False:
        return ["false schema"]
    errs: list[str] = []
    if "$ref" in schema:
        node = root
        for key in schema["$ref"][2:].split("/"):
            node = node[key]
        errs += schema_errors(node, value, root)
    if "const" in schema and value != schema["const"]:
        errs.append(f"{value!r} != const {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{value!r} not in enum")
    for sub in schema.get("allOf", ()):
        errs += schema_errors(sub, value, root)
    if "anyOf" in schema and all(schema_errors(s, value, root) for s in schema["anyOf"]):
        errs.append(f"{value!r} matches no anyOf branch")
    if "oneOf" in schema:
        n = sum(not schema_errors(s, value, root) for s in schema["oneOf"])
        if n != 1:
            errs.append(f"{value!r} matches {n} oneOf branches")
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        if not any(_is_type(value, t) for t in types):
            errs.append(f"{value!r} is not {types}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                errs.append(f"missing {name!r}")
        for name, v in value.items():
            if name in props:
                errs += schema_errors(props[name], v, root)
            elif "additionalProperties" in schema:
                errs += schema_errors(schema["additionalProperties"], v, root)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errs.append("too few items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append("too many items")
        prefix = schema.get("prefixItems", [])
        for i, v in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items", True)
            errs += schema_errors(sub, v, root)
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errs.append("too short")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errs.append("too long")
    if isinstance(value, int | float) and not isinstance(value, bool):
        for key, ok in (
            ("minimum", lambda b: value >= b),
            ("maximum", lambda b: value <= b),
            ("exclusiveMinimum", lambda b: value > b),
            ("exclusiveMaximum", lambda b: value < b),
            ("multipleOf", lambda b: math.isclose(value / b, round(value / b), abs_tol=1e-9)),
        ):
            if key in schema and not ok(schema[key]):
                errs.append(f"{value!r} breaks {key} {schema[key]!r}")
    return errs


def _is_type(value: Any, t: str) -> bool:
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    return {
        "object": lambda: isinstance(value, dict),
        "array": lambda: isinstance(value, list),
        "string": lambda: isinstance(value, str),
        "number": lambda: isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": lambda: isinstance(value, bool),
        "null": lambda: value is None,
    }[t]()


def assert_valid(schema: dict[str, Any], value: Any) -> None:
    # Through JSON, as a client receives it.
    assert schema_errors(schema, json.loads(json.dumps(value))) == []


# --- pydantic schemas ----------------------------------------------------------------


class Color(enum.StrEnum):
    red = "red"
    blue = "blue"


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    bark: float = Field(gt=0, lt=0.01)


class Node(BaseModel):
    name: str
    children: list[Node] = []
    parent: Node | None = None


class Everything(BaseModel):
    title: str = Field(min_length=5, max_length=7)
    when: datetime.datetime
    day: datetime.date
    id: uuid.UUID
    color: Color
    tags: list[str] = Field(min_length=2)
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    pair: tuple[int, str]
    tree: Node
    maybe: int | None = None
    score: float = Field(multiple_of=0.25, gt=3)
    mapping: dict[str, int]
    flag: bool
    odd: int = Field(gt=10, lt=12)


@pytest.mark.parametrize("strict", [False, True])
def test_a_pydantic_models_instance_validates_with_the_model(strict: bool) -> None:
    schema = Everything.model_json_schema()
    text = json.dumps(instance(schema, strict=strict))
    model = Everything.model_validate_json(text)
    assert model.odd == 11
    assert len(model.tags) == 2
    assert_valid(schema, json.loads(text))


def test_strict_fills_every_property_and_a_recursive_model_still_ends() -> None:
    value = instance(Everything.model_json_schema(), strict=True)
    assert set(value) == set(Everything.model_fields)
    Node.model_validate(value["tree"])  # nested, finite
    assert instance(Node.model_json_schema(), strict=True)["children"]


# --- hand-written schemas ------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def test_required_only_unless_strict() -> None:
    assert instance(WEATHER) == {"city": "sim", "unit": "celsius"}
    assert instance(WEATHER, strict=True) == {"city": "sim", "unit": "celsius", "days": 1}


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"const": 7}, 7),
        ({"enum": ["b", "a"]}, "b"),
        ({"type": ["null", "string"]}, None),
        ({"type": "boolean"}, True),
        ({"type": "number"}, 1.0),
        ({"type": "integer", "minimum": 5}, 5),
        ({"type": "integer", "exclusiveMaximum": 0}, -1),
        ({"type": "integer", "minimum": 3, "multipleOf": 4}, 4),
        ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.2}, 1.1),
        ({"type": "number", "minimum": 2, "exclusiveMinimum": True}, 3.0),  # draft-04
        ({"type": "string", "format": "date"}, "2024-01-01"),
        ({"type": "string", "maxLength": 2}, "si"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 3}, [1, 1, 1]),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 0}, []),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "sim"),
        ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, 1),
        ({"allOf": [{"properties": {"a": {"const": 1}}, "required": ["a"]},
                    {"properties": {"b": {"const": 2}}, "required": ["b"]}]}, {"a": 1, "b": 2}),
        ({"$defs": {"X": {"type": "integer", "minimum": 9}}, "$ref": "#/$defs/X"}, 9),
        ({"definitions": {"X": {"const": "x"}},
          "type": "object", "properties": {"x": {"$ref": "#/definitions/X"}}, "required": ["x"]},
         {"x": "x"}),
        ({"required": ["free"]}, {"free": "sim"}),
        ({}, None),
    ],
)
def test_instances(schema: dict[str, Any], expected: Any) -> None:
    value = instance(schema)
    assert value == pytest.approx(expected) if isinstance(expected, float) else value == expected
    assert_valid(schema, value)


def test_a_ref_that_does_not_resolve_or_a_required_cycle_is_an_error() -> None:
    with pytest.raises(SchemaError):
        instance({"$ref": "#/$defs/missing"})
    with pytest.raises(SchemaError):
        instance({"$ref": "https://example.com/schema"})
    cycle = {"$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
                             "required": ["a"]}}, "$ref": "#/$defs/A"}
    with pytest.raises(SchemaError):
        instance(cycle)


# --- random schemas ------------------------------------------------------------------

_names = st.sampled_from(["a", "b", "c", "d"])
_leaf = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n},
              st.integers(0, 5), st.integers(0, 5)),
    st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n},
              st.integers(-50, 50), st.integers(0, 5)),
    st.builds(lambda lo, m: {"type": "integer", "minimum": lo, "multipleOf": m},
              st.integers(-50, 50), st.integers(1, 7)),
    st.builds(lambda lo: {"type": "number", "exclusiveMinimum": lo}, st.floats(-1e6, 1e6)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.integers() | st.text(), min_size=1)),
    st.builds(lambda v: {"const": v}, st.integers() | st.text()),
)


def _compound(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    obj = st.builds(
        lambda props, extra: {
            "type": "object",
            "properties": props,
            "required": [k for i, k in enumerate(props) if i % 2 == 0],
            "additionalProperties": extra,
        },
        st.dictionaries(_names, children, max_size=4),
        st.booleans(),
    )
    arr = st.builds(
        lambda items, lo: {"type": "array", "items": items, "minItems": lo},
        children, st.integers(0, 3),
    )
    any_of = st.builds(lambda bs: {"anyOf": bs}, st.lists(children, min_size=1, max_size=3))
    nullable = st.builds(lambda c: {"anyOf": [c, {"type": "null"}]}, children)
    return st.one_of(obj, arr, any_of, nullable)


@settings(max_examples=300, deadline=None)
@given(st.recursive(_leaf, _compound, max_leaves=12), st.booleans())
def test_random_schemas_get_valid_instances(schema: dict[str, Any], strict: bool) -> None:
    assert_valid(schema, instance(schema, strict=strict))
