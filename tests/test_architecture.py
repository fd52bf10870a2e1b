"""The package's shape: no import cycles, no import-time patching, no pointers outside the repo."""

from __future__ import annotations

import ast
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


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Modules of the package that ``tree`` imports, anywhere but under ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def resolve(base: str, name: str | None) -> None:
        if name is not None and f"{base}.{name}" in known:
            found.add(f"{base}.{name}")  # `from . import x` names a submodule
        elif base in known:
            found.add(base)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module or ""
            for alias in node.names:
                resolve(base, alias.name)
        for sub in ast.iter_child_nodes(node):
            visit(sub)

    visit(tree)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    return {
        name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in files.items()
    }


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
    assert _imports(tree, "p.a", False, known) == {"p.b", "p.c", "p.d"}


def test_no_import_cycles_in_the_package() -> None:
    graph = import_graph()
    # The top package re-exports the app; every module may import it implicitly.
    graph.pop("aiserve_trio", None)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_importing_the_package_leaves_hypercorn_alone() -> None:
    probe = (
        "from hypercorn.trio import run\n"
        "before = run.TCPServer\n"
        "import aiserve_trio, aiserve_trio.asgi, aiserve_trio.hypercorn_seam\n"
        "aiserve_trio.app.get()\n"
        "assert run.TCPServer is before, 'importing aiserve_trio patched hypercorn'\n"
        "print(aiserve_trio.hypercorn_seam.install())\n"
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
    from aiserve_trio.http.hypercorn_version import supported

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
