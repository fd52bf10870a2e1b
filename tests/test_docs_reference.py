"""The reference pages against the gateway itself: every endpoint it serves, every metric
it exposes and every error code it can answer is on its page, and the endpoints page
lists nothing it does not serve.

The metrics and errors pages are generated (tools/metrics_reference.py,
tools/errors_reference.py, read from the source); here they are checked against what a
built gateway really has -- its ``/metrics`` text and its endpoint table -- and against
a plain search of the source, not against the generators' own reading.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

from tools import errors_reference, metrics_reference

from aiserve_trio.core import errors
from aiserve_trio.http.endpoints import Auth, Endpoint
from aiserve_trio.runtime.asgi import App

from .conftest import make_config
from .servers import ROOT

ENDPOINTS_PAGE = (ROOT / "docs" / "reference" / "endpoints.md").read_text()
WHO = {
    Auth.OPEN: "open",
    Auth.KEY: "key",
    Auth.CHAT: "route key",
    Auth.METRICS: "metrics",
    Auth.ADMIN: "admin",
    Auth.SESSION_READ: "key (session read)",
    Auth.SESSION_WRITE: "key (session write)",
    Auth.KEY_OR_STREAM_TOKEN: "key, or a stream token",
    Auth.ADMIN_OR_CONSOLE_TOKEN: "admin key or console token",
}


def everything_on() -> App:
    # the embedded default's routes, and the endpoints a setting adds
    mcp = '[mcp.servers.tools]\nurl = "http://127.0.0.1:9/mcp"\n'  # adds /mcp
    return App(make_config("[observability]\ndebug_requests = true\n" + mcp))


def page_rows() -> dict[tuple[str, str], str]:
    """(method, path) -> who, from the page's tables."""
    rows = re.findall(r"^\| (?:GET|POST|PUT|DELETE) \|", ENDPOINTS_PAGE, re.M)
    out: dict[tuple[str, str], str] = {}
    for line in ENDPOINTS_PAGE.splitlines():
        m = re.match(r"^\| (GET|POST|PUT|DELETE) \| `([^`]+)` \|(.*)$", line)
        if m:
            cells = [c.strip() for c in m.group(3).split("|")]
            # the API table has a `kind` column before "who"
            who = cells[1] if m.group(2).startswith("/v1/") and len(cells) == 4 else cells[0]
            out[(m.group(1), m.group(2))] = who
    assert len(out) == len(rows)  # no row listed twice
    return out


def test_every_endpoint_served_is_on_the_page_with_who_may_call_it():
    # EndpointTable iterates its endpoints (its __iter__ is typed as an Iterable)
    table = cast("Iterable[Endpoint]", everything_on().endpoints)
    served = {(m, ep.path): WHO[ep.auth] for ep in table for m in ep.methods}
    assert len(served) > 25
    assert page_rows() == served


def test_every_metric_exposed_is_on_the_page():
    page = metrics_reference.render()
    text = everything_on().metrics.render().decode()
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    assert len(families) > 40
    on_page = {m.exposed for m in metrics_reference.metrics()}
    # a counter's family is NAME_total, and prometheus_client adds NAME_created
    # (a counter's or a histogram's creation time) beside it
    bases = {n.removesuffix("_total").removesuffix("_created") for n in families}
    assert bases - on_page == set()
    for name in bases:
        assert f"`{name}" in page


def test_every_metric_registered_in_the_source_is_on_the_page():
    # a plain search of the source, not the generator's reading of it
    registered: set[str] = set()
    for path in (ROOT / "src" / "aiserve_trio").rglob("*.py"):
        source = path.read_text()
        registered |= set(
            re.findall(r'(?:Counter|Gauge|Histogram|MetricFamily)\(\s*"([a-z_]+)"', source)
        )
    assert len(registered) > 40
    exposed = {m.exposed for m in metrics_reference.metrics()}
    assert {n.removesuffix("_total") for n in registered} - exposed == set()


def test_every_error_code_is_on_the_page():
    page = errors_reference.render()
    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.GatewayError)
    ]
    assert len(classes) > 20
    for cls in classes:
        assert f"`{cls.__name__}`" in page
        if cls.default_code:
            assert f"| `{cls.default_code}` | {cls.status} |" in page
    raised: set[str] = set()
    for path in (ROOT / "src" / "aiserve_trio").rglob("*.py"):
        raised |= set(re.findall(r'\bcode="([a-z_]+)"', path.read_text()))
    assert len(raised) > 30
    missing = sorted(code for code in raised if f"| `{code}` |" not in page)
    assert missing == []
