"""The gateway's TOML configuration: msgspec Structs, loaded and validated once.

The app reads the file named by ``AISERVE_CONFIG``, else the embedded default
(``aiserve_trio/aiserve.toml``, the same file as ``configs/aiserve.toml``).
Anything wrong -- an unknown key, a wrong type, budgets that do not sum to 1,
a route naming an unknown adapter or policy -- raises :class:`ConfigError`
with the file and the TOML key, and the server does not start.

Checks live in two places: a section's own rules in its ``__post_init__``
(msgspec runs them while decoding and gives the key), and the rules between
sections in :func:`check_config`. Loading never changes what was decoded:
what the loader adds (where the file is, the keys of ``[auth] keys_file``,
the ``[policies.NAME]`` tables decoded into their kinds' settings) goes into a
new Struct.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from .adapters.settings import AdapterConfig, Fail, UpstreamTLS, check_groups

# Re-exported (`X as X`) for the tests and tools that import them from here: the
# adapters' Structs, CacheConfig, SessionsConfig, LimitsConfig, CorsConfig and its
# default headers, RouteConfig. Each lives with its package; code in src/ imports it
# from there.
from .adapters.settings import AnthropicAdapterConfig as AnthropicAdapterConfig
from .adapters.settings import AzureOpenAIAdapterConfig as AzureOpenAIAdapterConfig
from .adapters.settings import BedrockAdapterConfig as BedrockAdapterConfig
from .adapters.settings import GeminiAdapterConfig as GeminiAdapterConfig
from .adapters.settings import GroupAdapterConfig as GroupAdapterConfig
from .adapters.settings import GroupDeployment as GroupDeployment
from .adapters.settings import MockAdapterConfig as MockAdapterConfig
from .adapters.settings import MockRule as MockRule
from .adapters.settings import OpenAIAdapterConfig as OpenAIAdapterConfig
from .adapters.settings import VllmWsAdapterConfig as VllmWsAdapterConfig
from .adapters.tls import check_tls_files
from .audit.settings import AuditConfig as AuditConfig
from .cache.settings import CacheConfig as CacheConfig
from .chains.steps import StepConfig as StepConfig
from .core.budgets import BudgetsConfig, DeadlineConfig
from .core.decoding import Section as _Section
from .core.decoding import as_field, config_roots, confined, decode_toml, field_error, outside

# ConfigError lives with the other errors; re-exported for code that imports it from here.
from .core.errors import ConfigError as ConfigError
from .core.tenants import check_tenant
from .http.settings import CORS_ALLOW_HEADERS as CORS_ALLOW_HEADERS
from .http.settings import CORS_EXPOSE_HEADERS as CORS_EXPOSE_HEADERS
from .http.settings import CorsConfig as CorsConfig
from .mcp.settings import McpConfig
from .observability.settings import MetricsConfig, ObservabilityConfig
from .policies import registry
from .policies.base import BuildContext, Policy, PolicySpec
from .policies.registry import decode_policies, known_policies
from .record.settings import RecordConfig, check_record
from .routes import (
    LABEL_RE,
    chain_policies,
    check_cache,
    check_routing,
    check_steps,
    check_wire,
    route_label,
)
from .routes import RouteConfig as RouteConfig
from .security.settings import AuthConfig, KeysFile, read_keys_file
from .security.settings import LimitsConfig as LimitsConfig
from .sessions.settings import SessionsConfig as SessionsConfig
from .spend.settings import PricingConfig, TenantConfig, unkept

#: The keys file's table (``[auth] keys_file``), as the tests and docs tools name it.
_KeysFile = KeysFile

DEFAULT_CONFIG_NAME = "aiserve.toml"
ENV_VAR = "AISERVE_CONFIG"


_HOST_RE = re.compile(r"^(?:[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?|\[[0-9a-f:.]+\])$")


class ServerConfig(_Section):
    name: str = "aiserve-trio"
    #: Tenant used when no authenticated tenant is known (auth comes later).
    default_tenant: str = "default"
    #: Accepted ``X-Channel`` values; the first is used when the header is absent.
    channels: list[str] = msgspec.field(
        default_factory=lambda: ["api", "app", "wechat", "ivr", "pad", "web"]
    )
    #: Seconds between looks at the config file (and the keys file and rule pack
    #: files it names): a change is loaded as ``POST /admin/config/reload`` would
    #: (0: not watched).
    reload_watch_s: float = 5.0
    #: Folders besides the config's own (relative ones from it) that its keys file
    #: and rule pack files may be in; anything else is not read. Changed only on disk:
    #: a reload proposed over HTTP that changes it is refused.
    config_paths: list[str] = msgspec.field(default_factory=list)
    #: With auth off, the admin, console, debug and session endpoints answer only a
    #: ``Host`` that is a loopback name or address; these host names are accepted too.
    allowed_hosts: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.reload_watch_s < 0:
            raise field_error("reload_watch_s", "must not be negative (0: not watched)")
        for i, host in enumerate(self.allowed_hosts):
            if not _HOST_RE.match(host):
                why = f"must be a lower-case host name or address without a port, got {host!r}"
                raise field_error(f"allowed_hosts[{i}]", why)
        if not self.channels:
            raise field_error("channels", "must name at least one channel")
        for i, ch in enumerate(self.channels):
            if not LABEL_RE.match(ch):
                raise field_error(f"channels[{i}]", f"must match {LABEL_RE.pattern}, got {ch!r}")
        as_field("default_tenant", check_tenant, self.default_tenant)


class Config(_Section):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    deadline: DeadlineConfig = msgspec.field(default_factory=DeadlineConfig)
    budgets: BudgetsConfig = msgspec.field(default_factory=BudgetsConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    adapters: dict[str, AdapterConfig] = msgspec.field(default_factory=dict)
    routes: list[RouteConfig] = msgspec.field(default_factory=list)
    sessions: SessionsConfig = msgspec.field(default_factory=SessionsConfig)
    #: ``[policies.NAME]`` tables as written (``kind`` optional); the loader
    #: decodes them into :attr:`policy_specs`.
    policies: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    observability: ObservabilityConfig = msgspec.field(default_factory=ObservabilityConfig)
    #: Required: auth is switched off only explicitly (``[auth] enabled = false``),
    #: and the server then says so loudly at start-up.
    auth: AuthConfig | None = None
    #: Browsers on other origins: off unless ``[cors]`` is there.
    cors: CorsConfig | None = None
    #: Traffic recording for ``aiserve-replay`` (off unless ``enabled``; record/settings.py).
    record: RecordConfig = msgspec.field(default_factory=RecordConfig)
    #: Where routes with ``cache`` keep their entries.
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    #: Prices per model (spend/settings.py); a model without one costs 0.
    pricing: PricingConfig = msgspec.field(default_factory=PricingConfig)
    #: Budgets per tenant (``[tenants.NAME]``).
    tenants: dict[str, TenantConfig] = msgspec.field(default_factory=dict)
    #: The audit log (audit/settings.py); off unless ``[audit]`` is there.
    audit: AuditConfig | None = None
    #: The MCP gateway's upstream servers (mcp/settings.py); no ``/mcp`` without one.
    mcp: McpConfig = msgspec.field(default_factory=McpConfig)
    #: Where the config came from, and the folder relative paths in it start from
    #: (both set by the loader; values written in the TOML are replaced).
    source: str = "<memory>"
    base_dir: str = "."
    #: Set by the loader (a value in the TOML is replaced): every
    #: ``[policies.NAME]`` table and every policy a route names, with its
    #: kind's settings Struct.
    policy_specs: dict[str, PolicySpec] = msgspec.field(default_factory=dict)

    def build_policies(self, names: list[str]) -> list[Policy]:
        """:func:`build_policies` with this config: for the packages whose settings the
        config assembles, which use it without importing it."""
        return build_policies(names, self)


# --- loading --------------------------------------------------------------------


def default_config_text() -> str:
    """The embedded default configuration (shipped inside the package)."""
    return (resources.files("aiserve_trio") / DEFAULT_CONFIG_NAME).read_text("utf-8")


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Load and validate a config.

    Args:
        path: a TOML file; ``None`` means ``$AISERVE_CONFIG`` or the embedded default.

    Raises:
        ConfigError: naming the file and the TOML key of the first problem found.
    """
    if path is None:
        path = os.environ.get(ENV_VAR) or None
    if path is None:
        return parse_config(default_config_text(), source=f"<embedded {DEFAULT_CONFIG_NAME}>")
    p = Path(path)
    try:
        text = p.read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: config file is not UTF-8") from exc
    return parse_config(text, source=str(p), base_dir=p.parent)


def parse_config(text: str, *, source: str = "<memory>", base_dir: Path | None = None) -> Config:
    """Decode and validate config TOML text.

    Args:
        source: names the text in error messages.
        base_dir: the folder relative paths in the config start from (default ``.``).

    Raises:
        ConfigError: naming ``source`` (or the keys file) and the TOML key of
            the first problem found.
    """
    decoded = decode_toml(text.encode("utf-8"), Config, source=source)
    cfg = _loaded(decoded, source=source, base_dir=str(base_dir) if base_dir is not None else ".")
    check_config(cfg)
    return cfg


def _loaded(decoded: Config, *, source: str, base_dir: str) -> Config:
    """``decoded`` with what the loader adds, as a new Struct (``decoded`` is not changed).

    Adds where the config came from, the keys of ``[auth] keys_file``, and the
    ``[policies.NAME]`` tables decoded into their kinds' settings.

    Raises:
        ConfigError: the keys file cannot be read or is not valid, or a policy
            table is not valid for its kind.
    """
    auth = decoded.auth
    roots = config_roots(source, base_dir, decoded.server.config_paths)
    if auth is not None and auth.keys_file is not None:
        file = Path(base_dir) / auth.keys_file
        if not confined(str(file), roots):
            why = outside("the keys file", auth.keys_file)
            raise ConfigError(f"{source}: key `auth.keys_file`: {why}")
        extra = read_keys_file(file, source)
        auth = msgspec.structs.replace(auth, keys=[*auth.keys, *extra])
    adapters = {
        name: check_tls_files(cfg, f"adapters.{name}", base_dir, source, roots)
        if isinstance(cfg, UpstreamTLS)
        else cfg
        for name, cfg in decoded.adapters.items()
    }
    routed = [name for route in decoded.routes for name in route.policies]
    routed += [name for route in decoded.routes for name in chain_policies(route)]
    routed += decoded.mcp.policies
    specs = decode_policies(decoded.policies, source=source, names=routed)
    return msgspec.structs.replace(
        decoded,
        source=source,
        base_dir=base_dir,
        auth=auth,
        policy_specs=specs,
        adapters=adapters,
    )


def check_config(cfg: Config) -> None:
    """The rules between sections (each section has checked its own fields).

    Routes name configured adapters and known policies, paths and labels are
    unique, route deadlines leave the reserve; auth is configured, its keys are
    unique and name configured routes and channels; a Redis rate limiter has a
    Redis session backend; ``[cors]`` allows any origin only with auth off;
    ``[record] routes`` are chat routes.
    Every policy a route names is built once, so a bad setting or rule pack is
    refused here rather than when the app starts.

    Raises:
        ConfigError: naming ``cfg.source`` and the TOML key of the first problem.
    """

    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{cfg.source}: key `{key}`: {why}")

    _check_auth(cfg, fail)
    check_groups(cfg.adapters, fail)
    if not cfg.routes:
        raise fail("routes", "at least one [[routes]] entry is needed")
    seen_paths: set[str] = set()
    seen_labels: set[str] = set()
    for i, route in enumerate(cfg.routes):
        key = f"routes[{i}]"
        if route.path in seen_paths:
            raise fail(f"{key}.path", f"{route.path!r} is served by an earlier route")
        seen_paths.add(route.path)
        _check_route(i, route, cfg, fail, seen_labels)
    chat = [r.path for r in cfg.routes if r.kind == "chat"]
    if (problem := check_record(chat, cfg.record)) is not None:
        raise fail(*problem)
    build_policies(list(dict.fromkeys(n for r in cfg.routes for n in r.policies)), cfg)
    build_policies(cfg.mcp.policies, cfg)  # [mcp] policies: known names


def _check_auth(cfg: Config, fail: Fail) -> None:
    """``[auth]`` against the rest: it is there, its keys are unique and name configured
    routes and channels, ``[cors]`` and the rate limiter's backend agree with it, the
    tenants' names are valid, and the audit log keeps every budget's period."""
    auth = cfg.auth
    if auth is None:
        raise fail(
            "auth",
            "missing; add `[auth]` with `[[auth.keys]]`, or `[auth] enabled = false` "
            "to run without authentication (local use only)",
        )
    if auth.enabled and not auth.keys:
        raise fail("auth.keys", "auth is enabled but no key is configured")
    if auth.enabled and cfg.cors is not None and cfg.cors.allow_origins == ["*"]:
        why = '"*" (any origin) only with auth off; list the exact origins of your pages'
        raise fail("cors.allow_origins", why)
    if auth.ratelimit_backend == "redis" and cfg.sessions.backend != "redis":
        raise fail("auth.ratelimit_backend", "`redis` needs [sessions] backend = redis")
    seen: set[str] = set()
    paths = {r.path for r in cfg.routes} | {"*"}
    for i, k in enumerate(auth.keys):
        key = f"auth.keys[{i}]"
        if k.id in seen:
            raise fail(f"{key}.id", f"{k.id!r} is used by an earlier key")
        seen.add(k.id)
        for j, path in enumerate(k.routes):
            if path not in paths:
                raise fail(f"{key}.routes[{j}]", f"no route serves {path!r}")
        for j, ch in enumerate(k.channels):
            if ch != "*" and ch not in cfg.server.channels:
                raise fail(f"{key}.channels[{j}]", f"unknown channel {ch!r}")
    for name in cfg.tenants:
        try:
            check_tenant(name)
        except ValueError as exc:
            raise fail(f"tenants.{name}", str(exc)) from None
    if cfg.sessions.backend != "redis" and cfg.audit is not None and cfg.audit.backend != "off":
        budgets = [("key", k.id, k.budget_period) for k in auth.keys if k.budget is not None]
        budgets += [
            ("tenant", n, t.budget_period) for n, t in cfg.tenants.items() if t.budget is not None
        ]
        if (forgets := unkept(budgets, cfg.audit.retention_days)) is not None:
            raise fail("audit.retention_days", forgets)


def _check_route(i: int, route: RouteConfig, cfg: Config, fail: Fail, seen: set[str]) -> None:
    """Route ``i`` against the rest: its adapters, wire, label (not in ``seen``, the
    earlier routes'; added), cache, policies, deadlines and steps."""
    key = f"routes[{i}]"
    if route.adapters:
        check_routing(i, route, cfg.adapters, fail)
    check_wire(i, route, cfg.adapters, fail)
    if route.adapter not in cfg.adapters:
        known = ", ".join(sorted(cfg.adapters)) or "none"
        raise fail(f"{key}.adapter", f"unknown adapter {route.adapter!r} (configured: {known})")
    label = route_label(route)
    if label in seen:
        raise fail(f"{key}.name", f"{label!r} is used by an earlier route")
    seen.add(label)
    if route.kind == "embeddings" and route.policies:
        raise fail(f"{key}.policies", "policies apply to chat routes, not to embeddings")
    if route.cache is not None:
        check_cache(i, route, route.cache, cfg.adapters, fail)
    policy_names = known_policies(cfg.policy_specs)
    for j, policy in enumerate(route.policies):
        if policy not in policy_names:
            known = ", ".join(sorted(policy_names)) or "none"
            raise fail(f"{key}.policies[{j}]", f"unknown policy {policy!r} (known: {known})")
    reserve_ms = cfg.deadline.reserve_ms
    for field in ("default_ms", "max_ms"):
        ms = getattr(route.deadline, field)
        if ms is not None and ms <= reserve_ms:
            why = f"must exceed deadline.reserve_ms ({reserve_ms})"
            raise fail(f"{key}.deadline.{field}", why)
    default_ms = route.deadline.default_ms or cfg.deadline.default_ms
    max_ms = route.deadline.max_ms or cfg.deadline.max_ms
    if default_ms > max_ms:
        field = "default_ms" if route.deadline.default_ms is not None else "max_ms"
        why = f"the default ({default_ms} ms) must not exceed the maximum ({max_ms} ms)"
        raise fail(f"{key}.deadline.{field}", why)
    if route.steps:
        check_steps(i, route, cfg.adapters, policy_names, cfg.build_policies, fail)


def policy_context(cfg: Config) -> BuildContext:
    """What building a policy needs from ``cfg`` (``policies/`` never sees the whole config)."""
    return BuildContext(
        source=cfg.source,
        base_dir=cfg.base_dir,
        channels=tuple(cfg.server.channels),
        roots=config_roots(cfg.source, cfg.base_dir, cfg.server.config_paths),
    )


def build_policies(names: list[str], cfg: Config) -> list[Policy]:
    """The policies ``names`` (a route's, in order), built with ``cfg``'s specs.

    Raises:
        ConfigError: an unknown name, or settings or a rule pack that are not valid.
    """
    return registry.build_policies(names, cfg.policy_specs, policy_context(cfg))
