"""The error reference (docs/reference/errors.md), written from the code.

Each error a client can see is a ``GatewayError`` subclass in ``aiserve_trio.core.errors``
with its HTTP status, envelope ``type``, default ``code`` and docstring; the codes a
raise site gives instead (``BadRequest("...", code="unsupported_field")``) are found by
reading ``src/aiserve_trio`` with :mod:`ast`. Nothing is written by hand, so a new code
appears on the page at the next build; tests/test_docs_reference.py checks the page.
"""

from __future__ import annotations

import ast
import inspect
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "aiserve_trio"


@dataclass(frozen=True)
class ErrorClass:
    name: str
    status: int
    type: str
    default_code: str | None
    doc: str


def error_classes() -> list[ErrorClass]:
    from aiserve_trio.core import errors

    out: list[ErrorClass] = []
    for name, cls in vars(errors).items():
        if inspect.isclass(cls) and issubclass(cls, errors.GatewayError):
            doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
            out.append(ErrorClass(name, cls.status, cls.type, cls.default_code, doc))
    return out


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _trees() -> list[tuple[str, ast.AST]]:
    return [
        (str(path.relative_to(ROOT / "src")), ast.parse(path.read_text("utf-8"), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _carriers(trees: list[tuple[str, ast.AST]], names: set[str]) -> dict[str, str]:
    """Exceptions of a part that answers no request itself whose code a caller passes on:
    ``except EditError as exc: raise Unprocessable(..., code=exc.code)`` makes EditError's
    codes Unprocessable's."""
    out: dict[str, str] = {}
    for _, tree in trees:
        for handler in ast.walk(tree):
            if not (isinstance(handler, ast.ExceptHandler) and handler.name and handler.type):
                continue
            for node in ast.walk(handler):
                if isinstance(node, ast.Call) and _name(node.func) in names:
                    for kw in node.keywords:
                        v = kw.value
                        if (
                            kw.arg == "code"
                            and isinstance(v, ast.Attribute)
                            and v.attr == "code"
                            and isinstance(v.value, ast.Name)
                            and v.value.id == handler.name
                        ):
                            out[_name(handler.type)] = _name(node.func)
    return out


def raised_codes() -> dict[str, set[tuple[str, str]]]:
    """code -> {(error class, module)} for every literal ``code=`` given at a raise site
    (of an error class, or of an exception whose code an error class carries on)."""
    names = {c.name for c in error_classes()}
    trees = _trees()
    carriers = _carriers(trees, names)
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for module, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            name = carriers.get(name, name)
            if name not in names:
                continue
            for kw in node.keywords:
                if kw.arg == "code":
                    for value in _strings(kw.value):
                        found[value].add((name, module))
    return dict(found)


def _strings(node: ast.expr) -> list[str]:
    """The string literals an expression may be (``"a" if x else "b"`` gives both)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _strings(node.body) + _strings(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [s for value in node.values for s in _strings(value)]
    if isinstance(node, ast.JoinedStr):
        # made at run time: the template, its parts named (`expired_{purpose}_token`)
        return ["".join(_template_part(v) for v in node.values)]
    return []


def _template_part(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    inner = node.value if isinstance(node, ast.FormattedValue) else node
    return "{" + ast.unparse(inner).removeprefix("self.") + "}"


_INTRO = """\
# Error codes

An error before the first byte of a reply is an HTTP status with the API's error
envelope; after a stream has started it is a final event, and the stream is never cut
silently. On the OpenAI APIs (Chat Completions, Responses, embeddings, the gateway's
own endpoints) the envelope is

```json
{"error": {"message": "...", "type": "invalid_request_error",
           "code": "unsupported_field", "param": "logprobs"}}
```

and a stream's last events are `data: {"error": {...}}` then `data: [DONE]` (on
Responses, `response.failed`). On Anthropic's Messages API it is
`{"type": "error", "error": {"type": "...", "message": "..."}}` with Anthropic's types
and statuses (`529 overloaded_error`, `504 timeout_error`, ...), and a stream ends with
an `error` event. `Retry-After` comes with 429 and 503.

Besides the codes below: an input policy that blocks a request answers 403
`policy_violation` with the policy's name as its `code`, and an upstream's own error is
passed on with the code the provider gave where the API has one (Azure OpenAI's
`content_filter`, for one). A code with `{...}` in it is made when the error is raised.

This page is written from the code at every build: the error classes of
`aiserve_trio.core.errors` and every code a raise site in `src/aiserve_trio` names.
"""


def render() -> str:
    classes = error_classes()
    by_name = {c.name: c for c in classes}
    parts = [_INTRO, "\n## By status\n\n| status | type | default code | error | when |\n"]
    parts.append("|---|---|---|---|---|\n")
    for c in sorted(classes, key=lambda c: (c.status, c.name)):
        code = f"`{c.default_code}`" if c.default_code else "&nbsp;"
        parts.append(f"| {c.status} | `{c.type}` | {code} | `{c.name}` | {c.doc} |\n")
    codes: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for c in classes:
        if c.default_code:
            codes[c.default_code].add((c.name, "aiserve_trio/errors.py"))
    for code, sites in raised_codes().items():
        codes[code] |= sites
    parts.append("\n## Every code\n\n| code | status | raised as | in |\n|---|---|---|---|\n")
    for code in sorted(codes):
        sites = codes[code]
        statuses = sorted({by_name[n].status for n, _ in sites})
        errors = ", ".join(sorted({f"`{n}`" for n, _ in sites}))
        modules = ", ".join(sorted({f"`{m}`" for _, m in sites}))
        parts.append(f"| `{code}` | {', '.join(map(str, statuses))} | {errors} | {modules} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
