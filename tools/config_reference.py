"""The configuration reference (docs/reference/config.md), written from the config schema.

The schema is the msgspec Structs the loader decodes a config file into
(``aiserve_trio.config.Config`` and the tables it holds), the settings Struct of
each built-in policy kind (a ``[policies.NAME]`` table) and the rule pack and keys
files. For each table this walks the Struct with :mod:`msgspec.inspect` and writes
each key's TOML name, type and default; the key's text is the ``#:`` comment above
the field in its source (read with :mod:`ast` and :mod:`tokenize`, the code is not
imported for it), or else the comment beside the key in a shipped config
(``configs/*.toml``, ``configs/examples/*.toml``, read with tomlkit). Nothing here is
written by hand, so the page cannot drift from the schema; tests/test_docs_config.py
checks it against the schema and against every shipped config.

The product does not import this module: docs tooling stays out of ``src/``.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import tomlkit
from tomlkit.items import AoT, Table

ROOT = Path(__file__).resolve().parent.parent

#: Config fields the loader sets (a value written in the TOML is replaced).
LOADER_FIELDS = frozenset({"source", "base_dir", "policy_specs", "tls_files_digest"})


@dataclass
class Key:
    """One key of a table: its TOML name, type, default and text."""

    name: str
    type: str
    default: str
    doc: str


@dataclass
class Section:
    """One table of the reference.

    ``path`` is the table's TOML path (``routes.cache``, ``adapters.<name>``);
    ``variant`` the tag that selects it (``kind = "openai"``) or ``""``;
    ``array`` whether it is an array of tables (``[[routes]]``); ``schema`` the
    Struct's qualified name.
    """

    path: str
    variant: str
    array: bool
    schema: str
    doc: str
    keys: list[Key] = field(default_factory=list)
    #: A file other than the config (a rule pack, the keys file): its name, on the
    #: file's own section and on each table in it.
    file: str = ""

    @property
    def heading(self) -> str:
        if not self.path:
            return self.file
        head = f"[[{self.path}]]" if self.array else f"[{self.path}]"
        head = f"`{head}` {self.variant}".rstrip() if self.variant else f"`{head}`"
        return f"{head} in {self.file}" if self.file else head


# --- the schema ------------------------------------------------------------------


def _unwrap(t: mi.Type) -> tuple[mi.Type, bool]:
    """``X | None`` -> (X, True); anything else -> (t, False)."""
    if isinstance(t, mi.UnionType):
        rest = [u for u in t.types if not isinstance(u, mi.NoneType)]
        if len(rest) == 1 and len(rest) < len(t.types):
            return rest[0], True
    return t, False


def _structs(t: mi.Type) -> list[mi.StructType]:
    """The Structs a table-valued type holds (one, or a tagged union's variants)."""
    if isinstance(t, mi.StructType):
        return [t]
    if isinstance(t, mi.UnionType):
        found = [u for u in t.types if isinstance(u, mi.StructType)]
        if found and all(isinstance(u, mi.StructType | mi.NoneType) for u in t.types):
            return found
    return []


def type_name(t: mi.Type) -> str:
    """A key's type as a reader of TOML says it."""
    t, optional = _unwrap(t)
    name = _type_name(t)
    return f"{name} (optional)" if optional else name


def _type_name(t: mi.Type) -> str:
    simple: dict[type[mi.Type], str] = {
        mi.StrType: "string",
        mi.IntType: "integer",
        mi.FloatType: "number",
        mi.BoolType: "boolean",
        mi.AnyType: "any",
        mi.NoneType: "none",
    }
    for cls, name in simple.items():
        if isinstance(t, cls):
            return name
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(json.dumps(v) for v in t.values)
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        return f"array of {_plural(t.item_type)}"
    if isinstance(t, mi.DictType):
        return f"table of {_plural(t.value_type)}"
    if isinstance(t, mi.StructType):
        return "table"
    if isinstance(t, mi.UnionType):
        return " or ".join(_type_name(u) for u in t.types)
    return type(t).__name__.removesuffix("Type").lower()


def _plural(t: mi.Type) -> str:
    if isinstance(t, mi.StructType) or _structs(t):
        return "tables"
    name = _type_name(t)
    return {"string": "strings", "integer": "integers", "number": "numbers"}.get(name, name)


def _toml_value(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, msgspec.Struct):
        return "(a table of defaults)"
    if isinstance(value, int | float | str | list | dict | tuple):
        return msgspec.json.encode(value).decode().replace(",", ", ").replace(":", ": ")
    return repr(value)


def default_text(f: mi.Field) -> str:
    if f.required:
        return "required"
    if f.default is not msgspec.NODEFAULT:
        return _toml_value(f.default)
    factory: Callable[[], Any] = f.default_factory
    return _toml_value(factory())


# --- the text of each key ----------------------------------------------------------


@cache
def _field_comments(cls: type) -> dict[str, str]:
    """``#:`` comments above the fields of one class body (not its bases)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith("#:"):
            comments[tok.start[0]] = tok.string[2:].strip()
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    # A comment may speak for the fields right below it too (``body_read_timeout_ms``,
    # then ``body_total_timeout_ms`` and ``body_min_rate``, which it names): a field
    # without its own comment takes that of the run of fields it is in, when it is
    # named there.
    head = ""
    last_line = -1
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            lines: list[str] = []
            line = stmt.lineno - 1
            while line in comments:
                lines.insert(0, comments[line])
                line -= 1
            name = stmt.target.id
            if lines:
                head = out[name] = " ".join(lines)
            elif head and stmt.lineno == last_line + 1 and re.search(rf"\b{name}\b", head):
                out[name] = head
            elif stmt.lineno != last_line + 1:
                head = ""
            last_line = stmt.end_lineno or stmt.lineno
        else:
            head = ""
    return out


def field_doc(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if klass is msgspec.Struct or klass is object:
            break
        doc = _field_comments(klass).get(name)
        if doc:
            return doc
    return ""


def shipped_configs() -> list[Path]:
    """Every gateway config the repository ships (hypercorn's own configs are not)."""
    files = [
        ROOT / "configs" / "aiserve.toml",
        *sorted((ROOT / "configs" / "examples").glob("*.toml")),
    ]
    return [p for p in files if not p.name.startswith("hypercorn")]


def shipped_rule_packs() -> list[Path]:
    return sorted((ROOT / "configs" / "policies").glob("*.toml"))


@cache
def _shipped_comments() -> dict[str, str]:
    """``table.key`` -> the comment beside it in a shipped config (first one wins).

    Named tables read as ``<name>`` (``adapters.<name>.ttft_ms``), arrays of tables
    by their own name (``routes.path``).
    """
    out: dict[str, str] = {}

    def walk(container: Any, path: list[str], named: set[str]) -> None:
        for key, item in container.items():
            here = [*path, key]
            if isinstance(item, Table):
                if ".".join(path) in named:
                    here = [*path, "<name>"]
                walk(item, here, named)
            elif isinstance(item, AoT):
                for table in item:
                    walk(table, here, named)
            else:
                comment = item.trivia.comment.lstrip("#").strip() if hasattr(item, "trivia") else ""
                out.setdefault(".".join(here), comment)

    for path in shipped_configs():
        walk(tomlkit.parse(path.read_text("utf-8")), [], _NAMED_TABLES)
    return {k: v for k, v in out.items() if v}


#: Tables whose sub-tables are named by the user.
_NAMED_TABLES = {"adapters", "policies", "tenants", "pricing.models", "routes.steps.when"}


# --- the walk ----------------------------------------------------------------------


def sections() -> list[Section]:
    """Every table of the schema, in the order a config file has them."""
    from aiserve_trio.config import Config, _KeysFile
    from aiserve_trio.policies.antifraud import FraudPack
    from aiserve_trio.policies.compliance import CompliancePack
    from aiserve_trio.policies.registry import BUILTIN

    out: list[Section] = []
    root = mi.type_info(Config)
    assert isinstance(root, mi.StructType)
    _walk(root, [], "", False, out, top=True)
    for kind, spec in sorted(BUILTIN.items()):
        st = mi.type_info(spec.settings)
        assert isinstance(st, mi.StructType)
        first = len(out)
        keyed = keyed_by_data(spec.settings)
        _walk(st, ["policies", "<name>"], f'kind = "{kind}"', False, out, keyed_by_data=keyed)
        why = f"The policy's kind; a table named `{kind}` may leave it out."
        out[first].keys.insert(0, Key("kind", f'"{kind}"', "the table's name", why))
    for file, cls in (
        ("a compliance rule pack", CompliancePack),
        ("an anti-fraud rule pack", FraudPack),
        ("the keys file", _KeysFile),
    ):
        st = mi.type_info(cls)
        assert isinstance(st, mi.StructType)
        _walk(st, [], "", False, out, file=file)
    return out


def keyed_by_data(settings: type) -> bool:
    """Whether a policy kind's settings decode their table with their own ``from_table``
    (one keyed by data, ``[policies.channel-shaping.ivr]``), not key by key."""
    from aiserve_trio.policies.base import PolicySettings

    own = settings.__mro__[: settings.__mro__.index(PolicySettings)]
    return any("from_table" in vars(klass) for klass in own)


def _walk(
    st: mi.StructType,
    path: list[str],
    variant: str,
    array: bool,
    out: list[Section],
    *,
    top: bool = False,
    file: str = "",
    keyed_by_data: bool = False,
) -> None:
    """Add ``st``'s table, then the tables in it, to ``out``.

    ``keyed_by_data``: a policy's settings decoded by its own ``from_table`` from a table
    keyed by data (``[policies.channel-shaping.ivr]``): its one field, a table of tables,
    is the table itself, so its entries are ``[policies.<name>.<channel>]``.
    """
    cls = st.cls
    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
    if doc.startswith(("Base for", "A Struct", "Struct")):
        doc = ""
    section = Section(
        ".".join(path), variant, array, f"{cls.__module__}.{cls.__qualname__}", doc, file=file
    )
    later: list[tuple[mi.StructType, list[str], str, bool, str]] = []
    comments = _shipped_comments()
    for f in st.fields:
        if f.encode_name in LOADER_FIELDS:
            continue
        t, _ = _unwrap(f.type)
        sub = [*path, f.encode_name]
        structs = _structs(t)
        if structs:
            # a table in a table: a key (an inline table) and a section of its own
            later += [(s, sub, _tag(s), False, file) for s in structs]
        elif isinstance(t, mi.DictType) and _structs(t.value_type):
            named = f"<{f.encode_name.removesuffix('s')}>"
            entry = [*path, named] if keyed_by_data else [*sub, "<name>"]
            later += [(s, entry, _tag(s), False, file) for s in _structs(t.value_type)]
            if keyed_by_data:
                continue
        elif isinstance(t, mi.ListType) and _structs(t.item_type):
            later += [(s, sub, _tag(s), True, file) for s in _structs(t.item_type)]
        if top:
            # Config's own fields are the tables above; [policies.NAME] is free-form
            # there (each kind's settings are walked on their own).
            continue
        text = field_doc(cls, f.name) or comments.get(".".join(sub), "")
        section.keys.append(Key(f.encode_name, type_name(f.type), default_text(f), text))
    if not top:
        if st.tag_field is not None:
            section.keys.insert(
                0, Key(st.tag_field, f'"{st.tag}"', "required", "Selects this table's kind.")
            )
        out.append(section)
    for s, p, v, a, fl in later:
        _walk(s, p, v, a, out, file=fl)


def _tag(s: mi.StructType) -> str:
    return f'{s.tag_field} = "{s.tag}"' if s.tag_field is not None else ""


# --- the page ----------------------------------------------------------------------

_INTRO = """\
# Configuration reference

Every key a gateway config file may have, with its type, its default and what it
does. A config is TOML, named by `AISERVE_CONFIG` (the embedded default,
`configs/aiserve.toml`, when it is unset); an unknown key, or a value of the wrong
type, stops the load with an error naming `table.key`. Start from
`configs/aiserve.toml` or one of `configs/examples/`.

This page is written from the config schema (the msgspec Structs the loader decodes
into) when the site is built, so it lists exactly the keys the loader takes. A table
written `[adapters.<name>]` is one of many named by you; `[[routes]]` is an array of
tables; a table with a `kind = "..."` beside its name is the one that kind selects.
"""


def anchor(section: Section) -> str:
    raw = f"{section.file} {section.path} {section.variant}"
    slug = "".join(c if c.isalnum() else "-" for c in raw.lower())
    return "-".join(p for p in slug.split("-") if p)


_ROLE = re.compile(r":[a-z]+:`~?\.?([^`]+)`")


def markdown(doc: str) -> str:
    """A docstring's or comment's reST (``code``, :func:`x`) as Markdown."""
    return _ROLE.sub(r"`\1`", doc).replace("``", "`")


def _cell(text: str) -> str:
    return markdown(text).replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The Markdown of the reference page."""
    parts = [_INTRO]
    for s in sections():
        parts.append(f"\n## {s.heading} {{#{anchor(s)}}}\n")
        if s.doc:
            parts.append(f"\n{markdown(s.doc)}\n")
        parts.append(f"\nSchema: `{s.schema}`\n")
        if not s.keys:
            continue
        parts.append("\n| key | type | default | what it does |\n|---|---|---|---|\n")
        for k in s.keys:
            default = (
                k.default if k.default in ("required", "the table's name") else f"`{k.default}`"
            )
            doc = _cell(k.doc) or "&nbsp;"
            parts.append(f"| `{k.name}` | {_cell(k.type)} | {_cell(default)} | {doc} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
