"""The endpoint table a runtime is built with (``builder.RuntimeBuilder``), read directly:
which endpoint serves each path, what it needs and whose handler it is -- without a
request. The embedded default has a route of each kind (chat, embeddings, responses,
messages)."""

from __future__ import annotations

from functools import partial

from aiserve_trio.apis import CODECS
from aiserve_trio.http.endpoints import Admission, Auth, Endpoint
from aiserve_trio.runtime.gateway import Gateway, build_gateway

from .conftest import make_config


def table(extra: str = "") -> tuple[Gateway, dict[str, Endpoint]]:
    gw = build_gateway(make_config(extra))
    return gw, {ep.path: ep for ep in gw.generations.current.endpoints}


def test_each_route_is_served_by_its_kinds_handler_bound_to_the_runtime() -> None:
    gw, eps = table()
    rt = gw.generations.current
    for path, route in rt.routes.items():
        ep = eps[path]
        assert isinstance(ep.handler, partial)
        want = gw.builder.embed if route.config.kind == "embeddings" else gw.builder.chat
        assert ep.handler.func == want
        parts, served = ep.handler.args
        assert served is route
        assert parts.routes is rt.routes  # the parts this runtime was built from
        assert parts.pipeline is rt.pipeline
        assert (ep.methods, ep.auth, ep.admission) == (("POST",), Auth.CHAT, Admission.REQUEST)
        assert ep.name == route.label
        assert ep.errors is route.codec.error  # errors in the client API's own shape


def test_a_messages_route_counts_tokens_under_its_keys_and_limits() -> None:
    _, eps = table()
    ep = eps["/v1/messages/count_tokens"]
    assert ep.route == "/v1/messages"  # the route's keys, rate limit and channels
    assert (ep.auth, ep.name) == (Auth.CHAT, "count_tokens")
    assert ep.errors is CODECS["messages"].error
    assert not [p for p in eps if p.endswith("/count_tokens") and p != ep.path]


def test_probes_and_metrics_take_no_request_slot() -> None:
    _, eps = table()
    assert (eps["/healthz"].auth, eps["/healthz"].admission) == (Auth.OPEN, Admission.NONE)
    assert (eps["/readyz"].auth, eps["/readyz"].admission) == (Auth.OPEN, Admission.NONE)
    assert (eps["/metrics"].auth, eps["/metrics"].admission) == (Auth.METRICS, Admission.NONE)
    assert eps["/v1/sessions/{id}/events"].admission is Admission.STREAM


def test_the_recent_requests_are_an_admins_and_only_when_kept() -> None:
    _, eps = table()
    assert "/debug/requests/recent" not in eps
    _, eps = table("[observability]\ndebug_requests = true\n")
    operator = ["/debug/requests/recent", "/debug/profile", "/debug/trace", "/admin/usage"]
    operator += ["/admin/config", "/admin/config/reload"]
    assert all(eps[p].auth is Auth.ADMIN for p in operator)
    assert all(ep.auth is Auth.ADMIN for p, ep in eps.items() if p.startswith("/debug/"))


def test_an_unknown_path_needs_what_its_prefix_needs_before_it_hears_404() -> None:
    gw, _ = table()
    endpoints = gw.generations.current.endpoints
    assert endpoints.resolve("GET", "/admin/nothing")[0].auth is Auth.ADMIN
    assert endpoints.resolve("GET", "/debug/nothing")[0].auth is Auth.ADMIN
    assert endpoints.resolve("GET", "/v1/nothing")[0].auth is Auth.KEY
