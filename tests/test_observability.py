"""Latency diagnosis: spans and anchors, SLA metrics, exact task counts, baseline gauges,
the debug listing, and the ops files checked against what /metrics really exposes."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util.types import AnyValue

from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.observability.metrics import Metrics
from aiserve_trio.observability.sched import SchedulerLag
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body
from .conftest import make_config
from .fakes import RecordingAdapter
from .sim_gateway import chat, gateway_config, post, running
from .sim_process import run_sim

ROOT = Path(__file__).resolve().parent.parent
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def attrs(span: ReadableSpan) -> Mapping[str, AnyValue]:
    """A finished span's attributes (the SDK types them as optional)."""
    assert span.attributes is not None
    return span.attributes


def start(span: ReadableSpan) -> int:
    assert span.start_time is not None
    return span.start_time


def end(span: ReadableSpan) -> int:
    assert span.end_time is not None
    return span.end_time


def traced_app(extra: str = "") -> tuple[App, InMemorySpanExporter, RecordingAdapter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = make_config(extra)
    mock_cfg = cfg.adapters["mock"]
    assert isinstance(mock_cfg, MockAdapterConfig)
    rec = RecordingAdapter(MockAdapter("mock", mock_cfg))
    return App(cfg, adapters={"mock": rec}, tracer_provider=provider), exporter, rec


async def test_span_tree_anchors_and_trace_propagation(autojump_clock):
    app, exporter, rec = traced_app()
    r = await Client(app).chat(
        chat_body("echo: a b c", stream=True), headers={"traceparent": TRACEPARENT}
    )
    assert r.status == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST chat", "parse", "context", "inference", "sse"}
    root = spans["POST chat"]
    trace_id = root.context.trace_id
    # the incoming trace is continued
    assert format(trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert root.parent is not None
    assert format(root.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    for name in ("parse", "context", "inference", "sse"):
        parent = spans[name].parent
        assert parent is not None
        assert parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == trace_id
    # the anchors, in lifecycle order
    events = [(e.name, e.timestamp) for e in root.events]
    assert [n for n, _ in events] == [
        "gateway_receive_time",
        "inference_start_time",
        "first_token_time",
        "response_sent_time",
    ]
    times = [t for _, t in events]
    assert times == sorted(times)
    # the stage spans sit inside the request span, in pipeline order
    assert start(root) <= start(spans["parse"]) <= start(spans["context"])
    assert end(spans["sse"]) <= end(root)
    # the trace went upstream under the inference span
    upstream = rec.requests[0].forward_headers["traceparent"]
    assert upstream.split("-")[1] == format(trace_id, "032x")
    assert upstream.split("-")[2] == format(spans["inference"].context.span_id, "016x")
    # and back to the client
    tr = r.headers["traceresponse"].split("-")
    assert tr[1] == format(trace_id, "032x")
    assert tr[2] == format(root.context.span_id, "016x")
    assert attrs(root)["aiserve.outcome"] == "ok"


async def test_a_failed_request_has_an_error_span(autojump_clock):
    app, exporter, _ = traced_app()
    r = await Client(app).chat(
        chat_body("echo: " + " ".join(["w"] * 100), stream=True),
        headers={"X-Request-Timeout-Ms": "300"},
    )
    assert r.events()[-1] == "[DONE]"
    root = next(s for s in exporter.get_finished_spans() if s.name == "POST chat")
    assert root.status.status_code.name == "ERROR"
    assert attrs(root)["aiserve.outcome"] == "gateway_timeout"


async def test_tracing_off_sends_no_traceresponse(autojump_clock):
    app, exporter, _ = traced_app("[observability]\ntracing = false\n")
    r = await Client(app).chat(chat_body("echo: a"), headers={"traceparent": TRACEPARENT})
    assert "traceresponse" not in r.headers
    assert exporter.get_finished_spans() == ()


async def test_task_counts_return_to_zero_under_random_cancellation(autojump_clock):
    cfg = make_config(inter_token_ms="20")
    app = App(cfg)
    client = Client(app)
    rng = random.Random(42)
    body = chat_body("echo: " + " ".join(f"w{i}" for i in range(40)), stream=True)
    outcomes: list[str] = []

    async def one(i: int) -> None:
        await trio.sleep(rng.uniform(0, 0.5))
        headers = {"X-Request-Timeout-Ms": str(rng.choice([160, 300, 600, 5000]))}
        async with client.open(
            "POST", "/v1/chat/completions", json_body=body, headers=headers
        ) as ex:
            if rng.random() < 0.5:
                await trio.sleep(rng.uniform(0, 0.6))
                ex.disconnect()
            await ex.done.wait()
        outcomes.append("done")

    async with trio.open_nursery() as n:
        for i in range(200):
            n.start_soon(one, i)
    assert len(outcomes) == 200
    text = app.metrics.render().decode()
    for stage in ("parse", "context", "inference", "sse"):
        assert f'task_count_by_stage{{stage="{stage}"}} 0.0' in text
    counted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("aiserve_requests_total{")
    )
    assert counted == 200
    assert 'status="client_closed"' in text
    assert 'status="gateway_timeout"' in text
    assert 'status="ok"' in text


async def test_sla_metrics_by_route_and_model(client, app, autojump_clock):
    await client.chat(chat_body("echo: a b", stream=True))
    text = app.metrics.render().decode()
    assert 'aiserve_request_duration_seconds_count{model="aiserve_mock",route="chat"} 1.0' in text
    assert (
        'aiserve_model_time_to_first_token_seconds_count{model="aiserve_mock",route="chat"} 1.0'
        in text
    )
    assert (
        'aiserve_model_tokens_total{direction="completion",model="aiserve_mock",route="chat"} 2.0'
        in text
    )


async def test_baseline_gauges_are_published_every_window(autojump_clock):
    extra = "[observability]\nbaseline_window_s = 60\nbaseline_min_requests = 1\n"
    app = App(make_config(extra))
    client = Client(app)
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        for _ in range(3):
            for _ in range(5):
                await client.chat(chat_body("echo: a b c"))
            await trio.sleep(60)
        text = app.metrics.render().decode()
        nursery.cancel_scope.cancel()
    await app.shutdown()
    assert 'aiserve_baseline_observed_p90_seconds{route="chat"}' in text
    assert 'aiserve_baseline_predicted_p90_seconds{route="chat"}' in text
    assert 'aiserve_latency_anomaly{route="chat"} 0.0' in text
    assert re.search(r'aiserve_baseline_coefficient\{route="chat",term="c"\} [0-9.e-]+', text)


async def test_debug_listing_shows_the_slowest_with_stage_times(autojump_clock):
    app = App(make_config("[observability]\ndebug_requests = true\ndebug_keep = 2\n"))
    client = Client(app)
    for words in (1, 30, 5):
        await client.chat(chat_body("echo: " + " ".join(["w"] * words)))
    r = await client.request("GET", "/debug/requests/recent")
    listed = r.json()["requests"]
    assert len(listed) == 2
    assert listed[0]["total_ms"] >= listed[1]["total_ms"]
    assert listed[0]["total_ms"] == pytest.approx(10 + 29 * 5, abs=1)
    assert set(listed[0]["stages_ms"]) == {"parse", "context", "inference", "sse"}


async def test_debug_listing_is_off_by_default(client, autojump_clock):
    r = await client.request("GET", "/debug/requests/recent")
    assert r.status == 404


async def test_scheduler_lag_is_exported(app, client, autojump_clock):
    assert "trio_scheduler_lag_seconds_bucket" in app.metrics.render().decode()


# --- the ops files against the real metric names ---------------------------------


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def _exposed_names(text: str) -> set[str]:
    """Every series name /metrics declares, sampled yet or not (a labelled counter
    with no children is declared but has no sample until it first counts)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            base = name.removesuffix("_total")
            names.update(base + sfx for sfx in _SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


_FUNCS = {
    "sum",
    "rate",
    "by",
    "histogram_quantile",
    "clamp_min",
    "label_values",
    "le",
    "stage",
    "route",
    "model",
    "direction",
    "adapter",
    "code",
    "status",
    "ok",
    "client_closed",
    "parse",
    "context",
    "humanize",
    "humanizeDuration",
    "humanizePercentage",
    "value",
    "labels",
    "all",
    "e",
    "or",
    "on",
    "group_left",
    "max",
    "result",
}


def _metric_refs(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', "", expr)  # drop label values
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # drop range selectors
    tokens = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {t for t in tokens if t not in _FUNCS and not t.startswith("$")}


async def _scraped_names() -> set[str]:
    app = App(make_config("[observability]\nbaseline_window_s = 1\nbaseline_min_requests = 1\n"))
    client = Client(app)
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        for _ in range(2):
            await client.chat(chat_body("echo: a", stream=True))
            await client.chat(chat_body("echo: a"), headers={"X-Request-Timeout-Ms": "160"})
            await trio.sleep(1.5)
        text = app.metrics.render().decode()
        nursery.cancel_scope.cancel()
    await app.shutdown()
    return _exposed_names(text)


def _rule_file() -> dict[str, Any]:
    import yaml  # PyYAML comes with the test extras

    rules: dict[str, Any] = yaml.safe_load(
        (ROOT / "configs/prometheus/aiserve-rules.yml").read_text()
    )
    return rules


async def test_dashboard_and_rules_reference_only_existing_metrics(autojump_clock):
    exposed = await _scraped_names()
    rules = _rule_file()
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    rule_exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((ROOT / "configs/grafana/aiserve-dashboard.json").read_text())
    dash_exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    dash_exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    missing = []
    for expr in rule_exprs + dash_exprs:
        for name in _metric_refs(expr):
            if ":" in name:
                if name not in recorded:
                    missing.append((expr, name))
            elif name not in exposed:
                missing.append((expr, name))
    assert missing == []
    assert len(dashboard["panels"]) >= 8


RULES_TEST = ROOT / "configs/prometheus/aiserve-rules.test.yml"
#: Labels a scrape adds, and the bucket label of a histogram.
_SCRAPE_LABELS = {"job", "instance"}


def _rules_test() -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load(RULES_TEST.read_text())
    return loaded


def _series_labels(selector: str) -> tuple[str, set[str]]:
    """``name{a="x", b="y"}`` -> (name, {a, b})."""
    name, _, rest = selector.partition("{")
    return name.strip(), set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"', rest))


def _exported_labels() -> dict[str, set[str]]:
    """Every series name the gateway exports, with its label names."""
    metrics = Metrics()
    metrics.registry.register(SchedulerLag())
    found: dict[str, set[str]] = {}
    wrappers = [v for v in vars(metrics).values() if hasattr(v, "_labelnames")]
    wrappers += list(metrics.baseline.values())
    for metric in wrappers:
        labels = set(metric._labelnames)
        if metric._type == "counter":
            found[metric._name + "_total"] = labels
        elif metric._type == "histogram":
            found[metric._name + "_bucket"] = labels | {"le"}
            found[metric._name + "_count"] = found[metric._name + "_sum"] = labels
        else:
            found[metric._name] = labels
    for family in SchedulerLag().collect():
        for sample in family.samples:
            found[sample.name] = set(sample.labels)
    return found


def test_rule_tests_use_the_labels_the_gateway_exports():
    # promtool catches a rule that does not fit its input series; this catches
    # input series that do not fit what /metrics really says.
    exported = _exported_labels()
    wrong = []
    for test in _rules_test()["tests"]:
        for series in test["input_series"]:
            name, labels = _series_labels(series["series"])
            if name not in exported or labels - _SCRAPE_LABELS != exported[name]:
                wrong.append((name, sorted(labels), sorted(exported.get(name, {"<not exported>"}))))
    assert wrong == []


def test_every_rule_and_alert_has_a_promtool_test():
    groups = _rule_file()["groups"]
    records = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    tests = _rules_test()["tests"]
    tested_exprs = " ".join(t["expr"] for test in tests for t in test.get("promql_expr_test", []))
    tested_records = {name for name in records if re.search(re.escape(name) + r"\b", tested_exprs)}
    firing = {
        t["alertname"] for test in tests for t in test.get("alert_rule_test", []) if t["exp_alerts"]
    }
    assert records - tested_records == set()
    assert alerts - firing == set()


@pytest.mark.slow
def test_promtool_rule_unit_tests_pass():
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool (Debian package prometheus) must be installed"
    out = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name],
        cwd=RULES_TEST.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_the_sla_table_is_per_model():
    # Every column of the table reads a series with a model label: a recorded one
    # (its labels as the promtool tests expect them) or one the gateway exports.
    labels = {name: set(ls) for name, ls in _exported_labels().items()}
    for test in _rules_test()["tests"]:
        for t in test.get("promql_expr_test", []):
            recorded = re.search(r"aiserve:[a-z0-9_:]+", t["expr"])
            if recorded is None:
                continue
            for sample in t["exp_samples"]:
                labels.setdefault(recorded[0], set()).update(_series_labels(sample["labels"])[1])
    dashboard = json.loads((ROOT / "configs/grafana/aiserve-dashboard.json").read_text())
    (table,) = [p for p in dashboard["panels"] if p["title"].startswith("SLA per model")]
    exprs = [t["expr"] for t in table["targets"]]
    refs = {name for expr in exprs for name in _metric_refs(expr)}
    assert {name for name in refs if "model" not in labels.get(name, set())} == set()
    for wanted in (
        "aiserve:request_duration_seconds:p95",
        "aiserve:request_error_ratio:rate5m",
        "aiserve:tokens_per_request:avg5m",
        "aiserve:ttft_seconds:p95",
    ):
        assert wanted in refs


@pytest.mark.slow
def test_promtool_accepts_the_rules():
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool (Debian package prometheus) must be installed"
    out = subprocess.run(
        [promtool, "check", "rules", str(ROOT / "configs/prometheus/aiserve-rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.slow
async def test_each_upstream_attempt_is_a_span_under_inference() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with run_sim() as addr:
        cfg = gateway_config("openai", addr, headers={"x-sim-fault": "503", "x-sim-fault-times": "1"})
        app = App(cfg, tracer_provider=provider)
        async with running(app) as client:
            r = await post(client, chat(stream=True, max_tokens=3))
    assert r.status == 200
    spans = exporter.get_finished_spans()
    inference = next(s for s in spans if s.name == "inference")

    def attempt_number(s: ReadableSpan) -> int:
        n = attrs(s)["aiserve.attempt"]
        assert isinstance(n, int)
        return n

    attempts = sorted((s for s in spans if s.name == "upstream_attempt"), key=attempt_number)
    assert [attrs(s)["aiserve.attempt"] for s in attempts] == [1, 2]
    assert all(s.parent is not None and s.parent.span_id == inference.context.span_id for s in attempts)
    assert attrs(attempts[0])["aiserve.error_code"] == "upstream_status_error"
    assert "aiserve.error_code" not in attrs(attempts[1])
