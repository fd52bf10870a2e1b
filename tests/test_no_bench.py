"""The product does not depend on its benchmarks (issue 45): nothing under ``src/``
imports ``bench``, reads or names a path under ``bench/`` or a ``bench.`` module. The
code cites a measurement by its row in docs/benchmarks.md, which says which program
under ``bench/`` made it."""

from __future__ import annotations

import ast
import re

from .test_architecture import PKG, ROOT

#: A path under bench/ or a bench module (``bench/fairness.py``, ``python -m bench.ab``).
NAMED = re.compile(r"(?<![\w/.-])bench(?:/|\.[a-z_])")
DOCS = ROOT / "docs" / "benchmarks.md"


def bench_references(source: str) -> list[str]:
    """Where ``source`` imports ``bench`` or names a path or module of it (code, comments
    and docstrings alike)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if _bench(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _bench(node.module or ""):
            found.append(f"{node.lineno}: imports from {node.module}")
    for number, line in enumerate(source.splitlines(), start=1):
        if (m := NAMED.search(line)) is not None:
            found.append(f"{number}: names {m.group()}")
    return found


def _bench(module: str) -> bool:
    return module == "bench" or module.startswith("bench.")


def test_the_finder_finds_imports_and_names() -> None:
    source = (
        "import bench.ab\n"
        "from bench import loadgen\n"
        "# measured by bench/fairness.py\n"
        "# python -m bench.gc_cost\n"
        "# docs/benchmarks.md, fairness; the benchmarks; a workbench.x\n"
    )
    assert bench_references(source) == [
        "1: imports bench.ab",
        "2: imports from bench",
        "1: names bench.a",
        "3: names bench/",
        "4: names bench.g",
    ]


def test_nothing_in_the_product_names_the_benchmarks() -> None:
    found = [
        f"{path.relative_to(PKG)}:{where}"
        for path in sorted(PKG.rglob("*"))
        if path.suffix in {".py", ".toml", ".js", ".html", ".css"}
        for where in (
            bench_references(path.read_text())
            if path.suffix == ".py"
            else [f"{n}: names bench" for n, line in enumerate(path.read_text().splitlines(), 1)
                  if NAMED.search(line)]
        )
    ]  # fmt: skip
    assert found == []


def test_every_cited_measurement_has_its_row() -> None:
    """Each ``docs/benchmarks.md, NAME`` the code cites names a row of the page's table."""
    rows = re.findall(r"(?m)^\| ([^|]+?) \| `", DOCS.read_text())
    assert "ab" in rows
    cited, unknown = 0, []
    for path in sorted(PKG.rglob("*.py")):
        text = re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", path.read_text())  # comments joined
        for m in re.finditer(r"docs/benchmarks\.md, ", text):
            cited += 1
            after = text[m.end() : m.end() + 40]
            if not any(re.match(re.escape(row) + r"(?!\w)", after) for row in rows):
                unknown.append(f"{path.relative_to(PKG)}: {after}")
    assert cited >= 15
    assert unknown == []
