"""The metrics reference (docs/reference/metrics.md), written from the code that registers them.

Every ``Counter``, ``Gauge``, ``Histogram`` and ``Summary`` (prometheus_client) and every
``*MetricFamily`` a custom collector yields in ``src/aiserve_trio`` is found by reading
the source with :mod:`ast` (nothing is imported or run): its name, type, labels and help
text, as literals in the call. A call whose name is not a literal is an error here, so no
metric can be left off the page unseen. tests/test_docs_reference.py checks the page
against what a gateway's ``/metrics`` really exposes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "aiserve_trio"

_KINDS = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "CounterMetricFamily": "counter",
    "GaugeMetricFamily": "gauge",
    "HistogramMetricFamily": "histogram",
    "SummaryMetricFamily": "summary",
}


@dataclass(frozen=True)
class Metric:
    name: str  # as registered (a counter's ``_total`` is added when exposed)
    kind: str
    labels: tuple[str, ...]
    doc: str
    module: str  # path under src/

    @property
    def exposed(self) -> str:
        """The family name ``/metrics`` shows (``# TYPE`` line)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    @property
    def series(self) -> list[str]:
        base = self.exposed
        return {
            "counter": [f"{base}_total"],
            "histogram": [f"{base}_bucket", f"{base}_sum", f"{base}_count"],
            "summary": [f"{base}_sum", f"{base}_count"],
        }.get(self.kind, [base])


class _Unknown(Exception):
    pass


def _value(node: ast.expr | None, env: dict[str, object], loose: bool = False) -> object:
    """A literal expression's value, with the names of an enclosing loop bound in ``env``:
    constants, f-strings, lists and tuples, ``a if name == "x" else b``. ``loose``: a name
    in an f-string that is not bound reads as its own name (``in {currency}``: in
    *currency*), for help texts."""
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            inner = v.value if isinstance(v, ast.FormattedValue) else v
            try:
                parts.append(str(_value(inner, env)))
            except _Unknown:
                if not loose:
                    raise
                parts.append(f"*{ast.unparse(inner)}*")
        return "".join(parts)
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e, env) for e in node.elts]
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Compare):
        test = node.test
        if len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = _value(test.left, env), _value(test.comparators[0], env)
            return _value(node.body if left == right else node.orelse, env)
    raise _Unknown(ast.unparse(node))


def _loops(tree: ast.AST) -> dict[ast.AST, list[dict[str, object]]]:
    """For each comprehension over ``NAME.items()`` where NAME is a dict literal assigned
    in the same function: the bindings of its loop variables, one per entry."""
    out: dict[ast.AST, list[dict[str, object]]] = {}
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        literals: dict[str, ast.Dict] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        literals[target.id] = node.value
        for node in ast.walk(func):
            if not isinstance(node, ast.DictComp | ast.ListComp | ast.GeneratorExp):
                continue
            gen = node.generators[0]
            it = gen.iter
            if not (
                isinstance(it, ast.Call)
                and isinstance(it.func, ast.Attribute)
                and it.func.attr == "items"
                and isinstance(it.func.value, ast.Name)
                and it.func.value.id in literals
                and isinstance(gen.target, ast.Tuple)
                and len(node.generators) == 1
            ):
                continue
            names = [t.id for t in gen.target.elts if isinstance(t, ast.Name)]
            table = literals[it.func.value.id]
            try:
                envs = [
                    dict(zip(names, (_value(k, {}), _value(v, {})), strict=True))
                    for k, v in zip(table.keys, table.values, strict=True)
                ]
            except _Unknown:
                continue  # not a table of literals: not one a metric is made from
            for inner in ast.walk(node):
                out[inner] = envs
    return out


def metrics() -> list[Metric]:
    """Every metric the package registers, in source order, module by module."""
    found: list[Metric] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(ROOT / "src"))
        tree = ast.parse(path.read_text("utf-8"), str(path))
        loops = _loops(tree)
        here: list[tuple[int, Metric]] = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if kind not in _KINDS or not node.args:
                continue
            if kind == "Counter" and isinstance(node.args[0], ast.GeneratorExp):
                continue  # collections.Counter counts things
            for env in loops.get(node, [{}]):
                try:
                    here.append((node.lineno, _metric(node, kind, env, module)))
                except _Unknown as exc:
                    where = f"{module}:{node.lineno}"
                    raise ValueError(f"{where}: a {kind} the page cannot read: {exc}") from None
        found += [m for _, m in sorted(here, key=lambda pair: pair[0])]
    return found


def _metric(node: ast.Call, kind: str, env: dict[str, object], module: str) -> Metric:
    args = {i: a for i, a in enumerate(node.args)}
    keywords = {kw.arg: kw.value for kw in node.keywords if kw.arg}
    name = _value(args[0], env)
    doc = _value(args.get(1, keywords.get("documentation")), env, loose=True)
    labels = _value(args.get(2, keywords.get("labelnames", keywords.get("labels"))), env)
    if not isinstance(name, str):
        raise _Unknown(ast.unparse(args[0]))
    labels = labels if isinstance(labels, list) else []
    return Metric(name, _KINDS[kind], tuple(str(x) for x in labels), str(doc or ""), module)


_INTRO = """\
# Metrics

Every metric a worker exposes at `GET /metrics` (Prometheus text format; with auth on it
needs an admin key or the scrape token of `[auth] metrics_token_env`, unless
`[auth] metrics = "open"`), with its type, labels and help text. Label values are
`^[a-z][a-z0-9_]*$`. Tables other than the first appear only when their feature is on
(`[audit]`, `[record]`, budgets, the response cache).

This page is written from the code at every build: each metric's registration in
`src/aiserve_trio` is read, so a metric added there appears here. The ready-made alert
rules are in `configs/prometheus/`, a Grafana dashboard in `configs/grafana/`, and
what each bound's metric means in [Every bound, every fault](../operations.md).
"""


#: A heading for the metrics of each module (the module's path otherwise).
TITLES = {
    "aiserve_trio/observability/metrics.py": "Requests, stages, upstreams, caches, chains",
    "aiserve_trio/observability/sched.py": "The event loop",
    "aiserve_trio/audit/log.py": "The audit log (`[audit]`)",
    "aiserve_trio/record/recorder.py": "Traffic recording (`[record]`)",
    "aiserve_trio/spend/ledger.py": "Budgets",
    "aiserve_trio/spend/metrics.py": "Spend (`[pricing]`)",
}


def render() -> str:
    parts = [_INTRO]
    module = ""
    order = {name: i for i, name in enumerate(TITLES)}
    for m in sorted(metrics(), key=lambda m: order.get(m.module, len(order))):
        if m.module != module:
            module = m.module
            title = TITLES.get(module, f"`{module}`")
            parts.append(f"\n## {title}\n\nRegistered in `src/{module}`.\n\n")
            parts.append("| metric | type | labels | what it counts |\n")
            parts.append("|---|---|---|---|\n")
        labels = ", ".join(f"`{label}`" for label in m.labels) or "&nbsp;"
        doc = m.doc.replace("|", "\\|") or "&nbsp;"
        parts.append(f"| `{' '.join(m.series)}` | {m.kind} | {labels} | {doc} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
