"""The package's shape: no import cycles, no import-time patching, no pointers outside the repo."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .servers import hypercorn_gateway

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "aiserve_trio"
#: The steering documents that live beside the repository, not in it.
OUTSIDE_DOCS = re.compile(r"\b(?:DESIGN|FINDINGS|STYLE)[.]md\b")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> dict[str, bool]:
    """Modules of the package that ``tree`` imports, anywhere (inside functions and
    ``if TYPE_CHECKING:`` blocks too): each with True when it is imported at run time,
    False when only for type checking."""
    found: dict[str, bool] = {}
    package = module if is_package else module.rpartition(".")[0]

    def add(name: str, runtime: bool) -> None:
        found[name] = found.get(name, False) or runtime

    def resolve(base: str, name: str | None, runtime: bool) -> None:
        if name is not None and f"{base}.{name}" in known:
            add(f"{base}.{name}", runtime)  # `from . import x` names a submodule
        elif base in known:
            add(base, runtime)

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    add(alias.name, runtime)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module or ""
            for alias in node.names:
                resolve(base, alias.name, runtime)
        for sub in ast.iter_child_nodes(node):
            visit(sub, runtime)

    visit(tree, True)
    found.pop(module, None)
    return found


def typed_import_graph() -> dict[str, dict[str, bool]]:
    """Every module's imports of the package: True at run time, False for types only."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    return {
        name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in files.items()
    }


def import_graph() -> dict[str, set[str]]:
    """Every module's imports of the package, type-level ones included."""
    return {name: set(deps) for name, deps in typed_import_graph().items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := dfs(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_sees_relative_and_function_local_imports() -> None:
    tree = ast.parse(
        "from . import b\nfrom ..x import y\nimport p.c\n"
        "def f():\n    from .d import e\n"
        "if TYPE_CHECKING:\n    from .z import t\n"
    )
    known = {"p.a", "p.b", "p.c", "p.d", "x", "p.z"}
    assert _imports(tree, "p.a", False, known) == {
        "p.b": True,
        "p.c": True,
        "p.d": True,
        "p.z": False,  # a type-level import is an edge too
    }


def test_no_import_cycles_in_the_package() -> None:
    graph = import_graph()  # `if TYPE_CHECKING:` imports included
    # The top package re-exports the app; every module may import it implicitly.
    graph.pop("aiserve_trio", None)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# --- the package map ----------------------------------------------------------------

#: Every module may import these (docs/architecture.md's table says so in its header).
ANYONE = ("core", "config")

#: What each package (``name/``) or top-level module (``name.py``) may import of ours
#: besides :data:`ANYONE` and itself. An entry allows a module and everything under it;
#: ``:types`` allows it only under ``if TYPE_CHECKING:``; ``*`` allows everything.
#: docs/architecture.md's package map shows this as its last column
#: (``test_the_documented_map_is_the_enforced_one``).
PACKAGE_MAP: dict[str, tuple[str, ...]] = {
    "core/": (),
    "util/": (),
    "routes.py": (
        "adapters.settings",
        "cache.settings",
        "chains.plan",
        "chains.steps",
        "policies.base",
    ),
    "config.py": (
        "adapters.settings",
        "adapters.tls",
        "cache.settings",
        "sessions.settings",
        "policies.base",
        "policies.registry",
        "record.settings",
        "chains.steps",
        "audit.settings",
        "spend.settings",
        "security.settings",
        "http.settings",
        "observability.settings",
        "routes",
        "mcp.settings",
    ),
    "chains/": (
        "util.intents",
        "util.wav",
        "adapters.base",
        "adapters.sidecalls",
        "policies.base",
        "routes:types",
        "stages.types:types",
    ),
    "http/": ("security.auth:types",),
    "observability/": ("http.endpoints:types", "stages.outcome:types"),
    "policies/": ("adapters.base:types",),
    "adapters/": (
        "util.intents",
        "util.vectors",
        "util.wav",
        "observability.events",
        "observability.annotate",
        "routes",
    ),
    "sessions/": ("http", "util.redisconn", "observability.metrics:types", "stages.outcome:types"),
    "security/": (
        "http",
        "util.redisconn",
        "sessions.bus",
        "spend.budget",
        "spend.ledger",
        "spend.settings",
        "stages.outcome:types",
    ),
    "server/": ("http.types", "http.turns", "security.edge"),
    "cache/": (
        "adapters.base",
        "adapters.retry",
        "observability.events",
        "util.redisconn",
        "routes:types",
    ),
    "apis/": ("http.sse", "security.settings"),
    "stages/": (
        "adapters",
        "apis",
        "cache",
        "chains.plan",
        "chains.state",
        "http",
        "observability",
        "policies",
        "security.settings",
        "sessions.bus",
        "spend.prices",
        "routes:types",
        "server",
        "security.admission",
        "sessions.outbox:types",
    ),
    "runtime/": (
        "adapters",
        "endpoints.admin",
        "audit.log",
        "audit.usage",
        "cache.service",
        "console",
        "util.fdlimit",
        "util.gctune",
        "server",
        "observability",
        "record.recorder",
        "reload",
        "security.gate",
        "sessions",
        "spend.ledger",
        "spend.metrics",
        "spend.prices",
        "stages.types",
        "mcp.hub",
        "security.keystore.service",
        "apis",
        "http",
        "stages.outcome",
        "security.auth:types",
        "chains.run",
        "endpoints.count_tokens",
        "endpoints.embeddings",
        "stages.pipeline",
        "policies.base",
        "routes",
        "mcp.endpoint",
        "security.keystore.http",
        "cache:types",
    ),
    "mcp/": (
        "adapters.h1",
        "server",
        "audit.row",
        "audit.schema",
        "http",
        "policies.base",
        "audit.log:types",
        "observability.tracing:types",
        "security.gate:types",
        "record.mcpcall",
    ),
    "endpoints/": (
        "http",
        "audit.usage:types",
        "observability:types",
        "reload:types",
        "runtime.generation:types",
        "sessions.bus:types",
        "security.keystore.service:types",
        "adapters",
        "observability.metrics",
        "spend.prices",
        "stages",
        "util.vectors",
    ),
    "reload.py": ("adapters.settings",),
    "console/": (
        "http",
        "observability",
        "reload",
        "routes",
        "audit.usage",
        "security.gate:types",
        "security.keystore.service:types",
    ),
    "sim/": ("adapters.tokens", "util.intents", "util.vectors", "util.wav"),
    "record/": (
        "policies",
        "observability.metrics",
        "routes",
        "stages.outcome",
        "stages.types:types",
    ),
    "replay/": ("record.schema", "record.settings"),
    "spend/": (
        "observability.metrics",
        "util.redisconn",
        "adapters.base:types",
        "stages.outcome:types",
    ),
    "audit/": (
        "http",
        "observability.debug",
        "policies.redact",
        "policies.stream",
        "stages.outcome:types",
        "stages.types:types",
    ),
}


def unit_of(module: str) -> str:
    """The map's row of ``module`` (``aiserve_trio.x.y``): ``x/`` for a package, else ``x.py``."""
    top = module.split(".")[1]
    return f"{top}/" if (PKG / top).is_dir() else f"{top}.py"


def map_refusals(
    graph: dict[str, dict[str, bool]], package_map: dict[str, tuple[str, ...]]
) -> list[str]:
    """Each import in ``graph`` that ``package_map`` does not allow, as a sentence."""

    def covers(entry: str, target: str) -> bool:
        return target == entry or target.startswith(entry + ".")

    refused = []
    for module, deps in sorted(graph.items()):
        if module == "aiserve_trio":
            continue
        unit = unit_of(module)
        allowed = package_map.get(unit)
        if allowed is None:
            refused.append(f"{unit} has no row in the package map")
            continue
        for dep, runtime in sorted(deps.items()):
            target = dep.removeprefix("aiserve_trio.")
            if dep == "aiserve_trio" or unit_of(dep) == unit or "*" in allowed:
                continue
            if any(covers(e, target) for e in ANYONE):
                continue
            ok = any(
                covers(e.removesuffix(":types"), target)
                and (not runtime or not e.endswith(":types"))
                for e in allowed
            )
            if not ok:
                how = "imports" if runtime else "imports (for type checking)"
                refused.append(f"{module} {how} {dep}, which the map does not allow {unit}")
    return refused


def render_allowed(entries: tuple[str, ...]) -> str:
    """The package map's last column for a row (how docs/architecture.md writes it)."""
    if "*" in entries:
        return "everything"
    if not entries:
        return "—"
    words = [
        f"`{e.removesuffix(':types')}` (types)" if e.endswith(":types") else f"`{e}`"
        for e in entries
    ]
    return ", ".join(words)


def test_the_map_checker_refuses_what_the_map_does_not_allow() -> None:
    graph = {
        "aiserve_trio.policies.registry": {"aiserve_trio.stages.outcome": False},
        "aiserve_trio.observability.events": {"aiserve_trio.stages.outcome": True},
        "aiserve_trio.util.wav": {"aiserve_trio.core.errors": True},
    }
    package_map = {
        "policies/": (),
        "observability/": ("stages.outcome:types",),
        "util/": (),
    }
    assert map_refusals(graph, package_map) == [
        "aiserve_trio.observability.events imports aiserve_trio.stages.outcome, "
        "which the map does not allow observability/",
        "aiserve_trio.policies.registry imports (for type checking) aiserve_trio.stages.outcome, "
        "which the map does not allow policies/",
    ]
    assert map_refusals({"aiserve_trio.nowhere": {}}, {}) == [
        "nowhere.py has no row in the package map"
    ]


def test_every_import_is_one_the_package_map_allows() -> None:
    assert map_refusals(typed_import_graph(), PACKAGE_MAP) == []


def row_graph(graph: dict[str, dict[str, bool]]) -> dict[str, set[str]]:
    """The package map's rows as a graph: each row -> the rows its modules import at run
    time (an import under ``if TYPE_CHECKING:`` makes no floor: nothing runs it)."""
    rows: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module == "aiserve_trio":
            continue
        row = rows.setdefault(unit_of(module), set())
        row.update(unit_of(d) for d, runtime in deps.items() if runtime and d != "aiserve_trio")
        row.discard(unit_of(module))
    return rows


def test_the_floor_checker_finds_an_upward_import() -> None:
    graph = {
        "aiserve_trio.config": {"aiserve_trio.http.settings": True},
        "aiserve_trio.http.cors": {"aiserve_trio.config": True},
        "aiserve_trio.http.types": {"aiserve_trio.stages.outcome": False},
        "aiserve_trio.stages.outcome": {"aiserve_trio.http.types": True},
    }
    rows = row_graph(graph)
    assert rows == {"config.py": {"http/"}, "http/": {"config.py"}, "stages/": {"http/"}}
    assert find_cycle(rows) == ["config.py", "http/", "config.py"]
    del graph["aiserve_trio.http.cors"]
    assert find_cycle(row_graph(graph)) is None  # a type-level import is no floor


def test_the_packages_stand_in_floors() -> None:
    """No row imports, at run time, a row that imports it back, directly or through
    others: the rows stand in floors with every import pointing down -- the config
    above the settings modules it assembles, never imported by the packages that own
    them (issue 45: ``http/cors.py`` imported the config, ``spend/ledger.py`` the
    session bus's Redis module, ``record/``, ``audit/`` and ``chains/`` the config's
    ``build_policies``)."""
    cycle = find_cycle(row_graph(typed_import_graph()))
    assert cycle is None, "an upward import: " + " -> ".join(cycle or [])


def documented_map() -> dict[str, str]:
    """docs/architecture.md's package map: each row's names, with its last column."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Package map", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells[-1]
    return rows


def test_the_documented_map_is_the_enforced_one() -> None:
    documented = documented_map()
    assert sorted(documented) == sorted(PACKAGE_MAP), "rows differ from PACKAGE_MAP"
    wrong = {
        name: f"| ... | {render_allowed(PACKAGE_MAP[name])} |"
        for name, column in documented.items()
        if column != render_allowed(PACKAGE_MAP[name])
    }
    assert wrong == {}, "docs/architecture.md's package map says otherwise; write these"


# --- the hypercorn seam: one folder, no module state ------------------------------------

#: The package of the seam: the only place that may know hypercorn's internals.
SEAM_PACKAGE = "aiserve_trio.server"
#: What of hypercorn a module outside the seam may import: its documented API.
HYPERCORN_PUBLIC = {("hypercorn.config", "Config"), ("hypercorn.trio", "serve")}
#: The libraries whose private names are the seam's alone (hypercorn and its HTTP/2 one).
SEAM_LIBRARIES = ("hypercorn", "h2")
#: Methods that change a list, dict, set or bytearray in place.
MUTATORS = frozenset(
    {
        "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
        "setdefault", "add", "discard", "sort", "reverse", "__setitem__", "__delitem__",
    }
)  # fmt: skip
#: Module-level values a seam module may make with a call: they hold no state of ours.
STATELESS_CALLS = frozenset({"logging.getLogger"})


def private_names(library: str) -> set[str]:
    """The ``_``-prefixed names (not dunders) ``library`` defines anywhere in its source:
    functions, classes, module names and attributes it assigns."""
    spec = importlib.util.find_spec(library)
    assert spec is not None, library
    assert spec.submodule_search_locations, library
    names: set[str] = set()
    for root in spec.submodule_search_locations:
        for path in Path(root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__") and n != "_"}


def _line(sentence: str) -> int:
    """The line a checker's sentence (``module:line ...``) is about."""
    return int(sentence.split(" ", 1)[0].rpartition(":")[2])


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def seam_reach(
    tree: ast.AST, module: str, is_package: bool, private: set[str], exported: set[str]
) -> list[str]:
    """What a module outside the seam reaches of hypercorn's internals or of the seam's,
    as sentences: a hypercorn import beyond :data:`HYPERCORN_PUBLIC`, a ``private`` name
    of another object (not ``self``'s or ``cls``'s, and not one the module defines
    itself), in an attribute or a ``getattr`` string, ``__self__`` (a bound method's
    object: how hypercorn's objects are reached from the callables it hands the app), an
    import of a seam module, or of a name the seam does not export (``exported``)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Assign) and [_dotted(t) for t in node.targets] == ["__slots__"]:
            own.update(str(c.value) for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    foreign = (private - own) | {"__self__"}
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        at = f"{module}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hypercorn":
                    found.append(f"{at} imports {alias.name}")
                elif alias.name.startswith(SEAM_PACKAGE + "."):
                    found.append(f"{at} imports {alias.name}, inside the seam")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                if source.split(".")[0] == "hypercorn":
                    if (source, alias.name) not in HYPERCORN_PUBLIC:
                        found.append(f"{at} imports {alias.name} from {source}")
                elif source == "aiserve_trio" and alias.name == "server":
                    continue  # the package itself: its exported names
                elif source == SEAM_PACKAGE:
                    if alias.name not in exported:
                        found.append(f"{at} imports {alias.name}, which the seam does not export")
                elif source.startswith(SEAM_PACKAGE + "."):
                    found.append(f"{at} imports {alias.name} from {source}, inside the seam")
        elif isinstance(node, ast.Attribute) and node.attr in foreign:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{at} names {node.attr} of {_dotted(node.value) or 'an object'}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in foreign
        ):
            found.append(f"{at} names {node.args[1].value} through {node.func.id}")
    return sorted(found, key=_line)


def module_state(tree: ast.Module, module: str) -> list[str]:
    """The state ``tree`` (a seam module) keeps at module level, as sentences: a ``global``
    statement, a module-level value made by a call other than :data:`STATELESS_CALLS`, and
    a module-level or class-level list, dict, set or bytearray that the module changes."""
    found = []
    containers: dict[str, set[str]] = {"": set()}  # "" : module level; else a class's
    display = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    makers = {"list", "dict", "set", "bytearray", "OrderedDict", "defaultdict", "deque"}

    def bindings(body: list[ast.stmt]) -> list[tuple[str, ast.expr, int]]:
        out = []
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                targets = [t for t in stmt.targets if isinstance(t, ast.Name)]
                out += [(t.id, stmt.value, stmt.lineno) for t in targets]
            elif (
                isinstance(stmt, ast.AnnAssign)
                and stmt.value is not None
                and isinstance(stmt.target, ast.Name)
            ):
                out.append((stmt.target.id, stmt.value, stmt.lineno))
        return out

    def mutable(value: ast.expr) -> bool:
        if isinstance(value, display):
            return True
        return isinstance(value, ast.Call) and _dotted(value.func).split(".")[-1] in makers

    for name, value, line in bindings(tree.body):
        if mutable(value):
            containers[""].add(name)
        elif isinstance(value, ast.Call) and _dotted(value.func) not in STATELESS_CALLS:
            found.append(f"{module}:{line} keeps {name} = {_dotted(value.func)}(...)")
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef):
            containers[stmt.name] = {n for n, v, _ in bindings(stmt.body) if mutable(v)}

    def changed(target: ast.expr) -> str | None:
        """The container ``target`` (what is changed) is, if it is a kept one."""
        if isinstance(target, ast.Name) and target.id in containers[""]:
            return target.id
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            owner = target.value.id
            for cls, names in containers.items():
                if cls and target.attr in names and owner in ("self", "cls", cls):
                    return f"{cls}.{target.attr}"
        return None

    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Global):
            found.append(f"{module}:{line} has a global statement ({', '.join(node.names)})")
        what = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            what = changed(node.value)
        elif isinstance(node, ast.AugAssign):
            what = changed(node.target)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            what = changed(node.func.value)
        if what is not None:
            found.append(f"{module}:{line} changes {what}, kept at module level")
    return sorted(found, key=_line)


def _package_sources() -> dict[str, tuple[ast.Module, bool]]:
    return {
        _module_name(p): (ast.parse(p.read_text()), p.name == "__init__.py")
        for p in PKG.rglob("*.py")
    }


def _in_seam(module: str) -> bool:
    return module == SEAM_PACKAGE or module.startswith(SEAM_PACKAGE + ".")


def test_the_seam_checkers_refuse_what_they_should() -> None:
    reach = ast.parse(
        "import hypercorn.protocol.h2\n"
        "from hypercorn.config import Config\n"
        "from hypercorn.trio.task_group import _handle\n"
        "from .server import install, Worker\n"
        "from .server.tcp import GatewayH2\n"
        "from . import server\n"
        "class Mine:\n"
        "    __slots__ = ('_own',)\n"
        "    def __init__(self, group):\n"
        "        self._own = group._nursery\n"
        "        self._nursery = None\n"
        "def f(receive, tg, other):\n"
        "    other._own\n"
        "    tg._flush()\n"
        "    return getattr(receive, '__self__', None), receive.__self__\n"
        "def g(tg):\n"
        "    return getattr(tg, '_flush')()\n"
    )
    private = {"_nursery", "_flush", "_handle", "_own"}
    assert seam_reach(reach, "aiserve_trio.x", False, private, {"install"}) == [
        "aiserve_trio.x:1 imports hypercorn.protocol.h2",
        "aiserve_trio.x:3 imports _handle from hypercorn.trio.task_group",
        "aiserve_trio.x:4 imports Worker, which the seam does not export",
        "aiserve_trio.x:5 imports GatewayH2 from aiserve_trio.server.tcp, inside the seam",
        "aiserve_trio.x:14 names _flush of tg",
        "aiserve_trio.x:15 names __self__ through getattr",
        "aiserve_trio.x:15 names __self__ of receive",
        "aiserve_trio.x:17 names _flush through getattr",
    ]  # _nursery and _own: this module's own names
    state = ast.parse(
        "import logging\n"
        "log = logging.getLogger('x')\n"
        "TABLE = {1: 2}\n"
        "_views = {}\n"
        "_seen: list[int] = []\n"
        "_date = cached(format)\n"
        "class Box:\n"
        "    shared = {}\n"
        "    fine = []\n"
        "    def put(self, k):\n"
        "        self.shared[k] = 1\n"
        "def f(k):\n"
        "    global _box\n"
        "    _views[k] = 1\n"
        "    _seen.append(k)\n"
        "    return TABLE[k]\n"
    )
    assert module_state(state, "m") == [
        "m:6 keeps _date = cached(...)",
        "m:11 changes Box.shared, kept at module level",
        "m:13 has a global statement (_box)",
        "m:14 changes _views, kept at module level",
        "m:15 changes _seen, kept at module level",
    ]


def test_nothing_outside_the_seam_knows_hypercorns_internals_or_the_seams() -> None:
    import aiserve_trio.server

    private = set().union(*(private_names(lib) for lib in SEAM_LIBRARIES))
    exported = set(aiserve_trio.server.__all__)
    found = [
        line
        for module, (tree, is_package) in sorted(_package_sources().items())
        if not _in_seam(module)
        for line in seam_reach(tree, module, is_package, private, exported)
    ]
    assert found == []


def test_the_seam_keeps_no_state_in_its_modules() -> None:
    sources = _package_sources()
    seam = [m for m in sources if _in_seam(m)]
    assert len(seam) >= 10  # the checker sees the seam
    found = [line for m in sorted(seam) for line in module_state(sources[m][0], m)]
    assert found == []


def test_importing_the_package_leaves_hypercorn_alone() -> None:
    probe = (
        "from hypercorn.trio import run\n"
        "before = run.TCPServer\n"
        "import aiserve_trio, aiserve_trio.runtime.asgi, aiserve_trio.server\n"
        "aiserve_trio.app.get()\n"
        "assert run.TCPServer is before, 'importing aiserve_trio patched hypercorn'\n"
        "print(aiserve_trio.server.install())\n"
        "assert run.TCPServer is not before, 'install() did nothing'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "AISERVE_HYPERCORN_PATCHES"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False,
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("installed: hypercorn.trio.run.TCPServer")


def test_the_seam_refuses_a_hypercorn_it_does_not_know() -> None:
    from aiserve_trio.server.fingerprints import supported

    assert supported("0.18.0")
    assert not supported("0.19.1")
    assert not supported("garbage")


def test_nothing_points_to_documents_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".yml", ".json", ".txt", ""}:
            continue
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for m in OUTSIDE_DOCS.finditer(text):
            if not (ROOT / m.group()).exists():
                offenders.append(f"{name} mentions {m.group()}")
    assert offenders == []


@pytest.mark.slow
def test_the_server_log_says_whether_the_seam_is_installed() -> None:
    with hypercorn_gateway() as (_, proc):
        proc.terminate()
        assert proc.stdout is not None
        log = proc.stdout.read().decode()
    if os.environ.get("AISERVE_HYPERCORN_PATCHES") == "off":
        assert "hypercorn seam: off (AISERVE_HYPERCORN_PATCHES=off)" in log
    else:
        assert "hypercorn seam: installed: hypercorn.trio.run.TCPServer" in log
    assert "aiserve-trio ready" in log


# --- the core never asks which API it serves (issue 45, item 2) ---------------------

#: The pipeline's core: it reads ``info.route.codec`` and asks the codec what it can do.
CORE = ("stages", "runtime/entry.py")


def api_types() -> set[str]:
    """The classes of the client APIs (requests, views, framers: ``apis/``), and the
    chat framer the chat codec wraps."""
    names = {"ChatFramer"}
    for path in (PKG / "apis").glob("*.py"):
        tree = ast.parse(path.read_text())
        names.update(n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    return names - {"Codec", "NativeSpec", "Stored", "State", "Stream", "FramerStateError"}


def api_questions(source: str, types: set[str]) -> list[str]:
    """Where ``source`` asks which API it serves: ``CODECS`` looked up (a kind without a
    codec: None), or ``isinstance`` against an API's class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "CODECS":
            found.append(f"line {node.lineno}: CODECS")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for kind in kinds:
                name = kind.attr if isinstance(kind, ast.Attribute) else getattr(kind, "id", "")
                if name in types:
                    found.append(f"line {node.lineno}: isinstance(..., {name})")
    return sorted(found, key=lambda f: int(f.split(":")[0].removeprefix("line ")))


def test_the_api_question_finder_finds_both_kinds() -> None:
    source = (
        "codec = CODECS.get(kind)\n"
        "if isinstance(req.api, (int, ResponsesRequest)):\n"
        "    pass\n"
        "if isinstance(framer, sse.ChatFramer):\n"
        "    pass\n"
        "if isinstance(first, Replayed):\n"
        "    pass\n"
    )
    assert api_questions(source, api_types()) == [
        "line 1: CODECS",
        "line 2: isinstance(..., ResponsesRequest)",
        "line 4: isinstance(..., ChatFramer)",
    ]


def test_the_core_never_asks_which_api_it_serves() -> None:
    """Every route carries its API's codec (``Route.codec``; chat's is the identity one):
    no ``CODECS`` lookup that may find none, no ``isinstance`` on an API's request, view
    or framer in the stages, the pipeline or the entry -- what an API needs of them is a
    capability of its codec (``native``, ``stored``, ``id_prefix``)."""
    types = api_types()
    assert {"ResponsesRequest", "MessagesView", "ChatStreamFramer", "ChatFramer"} <= types
    offenders = []
    for entry in CORE:
        paths = sorted((PKG / entry).glob("*.py")) if entry == "stages" else [PKG / entry]
        for path in paths:
            offenders += [
                f"{path.relative_to(PKG)} {where}"
                for where in api_questions(path.read_text(), types)
            ]
    assert offenders == []


# --- the picture of the packages (issue 45) -----------------------------------------


def pictured() -> set[str]:
    """The names docs/architecture.md's picture of the packages shows: ``x/`` or ``x.py``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The packages at a glance", 1)[1].split("\n## ", 1)[0]
    tree = section.split("```", 2)[1]
    return set(re.findall(r"(?<![\w./])([a-z_]+/|[a-z_]+\.py)(?=\s)", tree)) - {"aiserve_trio/"}


def test_the_picture_of_the_packages_is_the_folder_listing() -> None:
    """Every package and top-level module is in the picture, each with a paragraph
    below it, and the picture names nothing that is not there."""
    listing = {f"{p.name}/" for p in PKG.iterdir() if (p / "__init__.py").exists()}
    listing |= {p.name for p in PKG.glob("*.py")}
    assert pictured() == listing
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The packages at a glance", 1)[1].split("\n## ", 1)[0]
    paragraphs = section.split("```", 2)[2]
    missing = [p for p in sorted(listing) if p.endswith("/") and f"`{p}`" not in paragraphs]
    assert missing == [], "packages without a paragraph"
