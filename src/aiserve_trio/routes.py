"""``[[routes]]``: a route's table, what is read off one route (its label, its
adapters, its chain's policies), and the rules between a route and the adapters it
names, which ``config.check_config`` runs with the whole config.

A leaf module (msgspec, the decoding helpers and the tables a route holds): the
config imports it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Literal

import msgspec

from .adapters.settings import AdapterConfig, adapter_kind
from .cache.settings import RouteCache
from .chains.plan import AdapterFacts, check_chain
from .chains.steps import StepConfig
from .core.decoding import Section, as_field, field_error, positive
from .core.tenants import check_tenant
from .policies.base import Policy

#: Metric labels: route names and channels.
LABEL_RE = re.compile(r"^[a-z][a-z0-9_]*$")
#: How a check names a problem: the TOML key and why (``config.check_config`` adds the file).
Fail = Callable[[str, str], Exception]


class RouteDeadline(Section):
    default_ms: int | None = None
    max_ms: int | None = None


class RouteConfig(Section):
    path: str
    #: The adapter that answers (with ``adapters``: the default, for a request naming
    #: no model; when left out, the first of ``adapters``).
    adapter: str = ""
    #: ``chat`` (Chat Completions through the pipeline), ``responses`` (OpenAI's
    #: Responses API) or ``messages`` (Anthropic's Messages API) through the same
    #: pipeline with their codecs (``apis/``), or ``embeddings``.
    kind: Literal["chat", "embeddings", "responses", "messages"] = "chat"
    #: On a ``messages`` or ``responses`` route whose backend speaks that API: pass
    #: the client's request and the provider's events through as they are (true),
    #: or translate them through the pipeline's Chat Completions shape as for any
    #: other backend (false: the response cache then serves the route too).
    native: bool = True
    #: Metric label for the route; default derived from the path.
    name: str = ""
    #: Model used when the request names none.
    default_model: str | None = None
    #: Seconds a session's context lives after its last use.
    context_ttl: int = 86_400
    policies: list[str] = msgspec.field(default_factory=list)
    deadline: RouteDeadline = msgspec.field(default_factory=RouteDeadline)
    on_context_timeout: Literal["fail", "degrade"] = "fail"
    tenant: str | None = None
    #: Caps on one reply. ``max_tokens``: the most a client may ask for, and what
    #: is sent upstream when it asks for nothing (the reply then ends with
    #: ``finish_reason: "length"``); ``max_reply_bytes``: content, reasoning and
    #: tool-call bytes delivered; ``max_stream_s``: seconds from the first byte.
    #: Beyond the last two the stream ends with an error event naming the cap.
    max_tokens: int | None = None
    max_reply_bytes: int | None = None
    max_stream_s: float | None = None
    #: The most one request reserves against its key's and tenant's budgets while it
    #: runs, in ``[pricing] currency`` (default: its maximum cost; ``spend/budget.py``).
    budget_reserve: float | None = None
    #: The response cache (off unless the route has this table).
    cache: RouteCache | None = None
    #: A chain of capabilities (``[[routes.steps]]``, ``chains/steps.py``); empty:
    #: the route's adapter answers, as on any route.
    steps: list[StepConfig] = msgspec.field(default_factory=list)
    #: Model routing: the request's ``model`` picks the adapter (of these and
    #: ``adapter``) whose ``models`` has it (``adapters/router.py``).
    adapters: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise field_error("path", f"must start with '/', got {self.path!r}")
        if not self.adapter:
            if not self.adapters:
                raise field_error("adapter", "missing: name the route's adapter (or `adapters`)")
            self.adapter = self.adapters[0]
        label = route_label(self)
        if not LABEL_RE.match(label):
            raise field_error("name", f"must match {LABEL_RE.pattern}, got {label!r}")
        positive(self, "context_ttl")
        for key in ("max_tokens", "max_reply_bytes", "max_stream_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise field_error(key, "must be positive")
        if self.budget_reserve is not None and self.budget_reserve < 0:
            raise field_error("budget_reserve", "must not be negative")
        if self.tenant is not None:
            as_field("tenant", check_tenant, self.tenant)


def route_label(route: RouteConfig) -> str:
    """The route's metric label: its ``name`` or one derived from its path."""
    if route.name:
        return route.name
    label = re.sub(r"[^a-z0-9]+", "_", route.path.lower()).strip("_")
    return label if label and label[0].isalpha() else f"r_{label}"


def route_adapters(route: RouteConfig) -> list[str]:
    """The adapters a route serves from: ``adapter`` first, then ``adapters``, once each."""
    return list(dict.fromkeys([route.adapter, *route.adapters]))


def route_models(adapters: Mapping[str, AdapterConfig], route: RouteConfig) -> dict[str, str]:
    """Each model a (checked) route serves -> the adapter that answers it."""
    out: dict[str, str] = {}
    for name in route_adapters(route):
        for model in adapters[name].models:
            out.setdefault(model, name)
    return out


def chain_policies(route: RouteConfig) -> list[str]:
    """The policies a route's ``rewrite`` steps name."""
    return [p for s in route.steps if (p := getattr(s, "policy", None)) is not None]


def check_routing(
    i: int, route: RouteConfig, adapters: Mapping[str, AdapterConfig], fail: Fail
) -> None:
    """A route with ``adapters``: not an embeddings route, without a cache or steps, whose adapters
    exist and never claim the same model (the request's model must pick one)."""
    key = f"routes[{i}]"
    if route.kind == "embeddings":
        raise fail(f"{key}.adapters", "model routing is for chat, responses and messages routes")
    if route.cache is not None:
        why = "a route with `adapters` has no response cache (its key holds one adapter)"
        raise fail(f"{key}.cache", why)
    if route.steps:
        why = "a route with `adapters` has no steps: a chain names its own adapters"
        raise fail(f"{key}.steps", why)
    named = [] if route.adapter in route.adapters else [(f"{key}.adapter", route.adapter)]
    named += [(f"{key}.adapters[{j}]", n) for j, n in enumerate(route.adapters)]
    owner: dict[str, str] = {}
    seen: set[str] = set()
    for where, name in named:
        if name not in adapters:
            known = ", ".join(sorted(adapters)) or "none"
            raise fail(where, f"unknown adapter {name!r} (configured: {known})")
        if name in seen:
            raise fail(where, f"{name!r} is named more than once")
        seen.add(name)
        for model in adapters[name].models:
            other = owner.setdefault(model, name)
            if other != name:
                raise fail(where, f"model {model!r} is served by both {other!r} and {name!r}")


def check_wire(
    i: int, route: RouteConfig, adapters: Mapping[str, AdapterConfig], fail: Fail
) -> None:
    """An adapter that speaks only the Responses API (``wire = "responses"``) serves only
    ``responses`` routes that pass their requests through to it."""
    for name in [route.adapter, *route.adapters]:
        adapter = adapters.get(name)
        if getattr(adapter, "wire", "chat") != "responses":
            continue
        if route.kind != "responses" or not route.native or route.steps:
            why = (
                f'adapter {name!r} has wire = "responses": it serves only responses '
                "routes without steps, natively (not native = false)"
            )
            raise fail(f"routes[{i}].adapter", why)


def check_steps(
    i: int,
    route: RouteConfig,
    adapters: Mapping[str, AdapterConfig],
    policy_names: set[str],
    build: Callable[[list[str]], list[Policy]],
    fail: Fail,
) -> None:
    """A chain (``routes[i].steps``): on a chat route without a cache, and sound
    (``chains/plan.py``); each ``rewrite`` step's policy, built by ``build``, rewrites
    output."""
    key = f"routes[{i}]"
    if route.kind == "embeddings":
        raise fail(f"{key}.steps", "steps are for chat routes")
    if route.cache is not None:
        why = "a route with steps has no response cache: its answer depends on every step's call"
        raise fail(f"{key}.cache", why)
    facts = {
        name: AdapterFacts(kind=adapter_kind(a), models=tuple(a.models))
        for name, a in adapters.items()
    }
    problem = check_chain(route.steps, route.adapter, facts, policy_names)
    if problem is not None:
        raise fail(f"{key}.{problem[0]}", problem[1])
    for j, step in enumerate(route.steps):
        name = getattr(step, "policy", None)
        if name is None:
            continue
        (policy,) = build([name])
        if type(policy).output_filter is Policy.output_filter:
            raise fail(f"{key}.steps[{j}].policy", f"{name!r} does not rewrite output")


def check_cache(
    i: int, route: RouteConfig, cache: RouteCache, adapters: Mapping[str, AdapterConfig], fail: Fail
) -> None:
    """Route ``i``'s ``cache``: on a chat route, for models its adapter serves, with a
    configured embeddings adapter when semantic."""
    key = f"routes[{i}]"
    if route.kind == "embeddings":
        raise fail(f"{key}.cache", "the response cache is for chat routes")
    served = getattr(adapters[route.adapter], "models", None)
    for j, model in enumerate(cache.models):
        if served is not None and model not in served:
            why = f"{model!r} is not served by adapter {route.adapter!r}"
            raise fail(f"{key}.cache.models[{j}]", why)
    sem = cache.semantic
    if sem is not None and sem.embeddings not in adapters:
        known = ", ".join(sorted(adapters))
        why = f"unknown adapter {sem.embeddings!r} (known: {known})"
        raise fail(f"{key}.cache.semantic.embeddings", why)
