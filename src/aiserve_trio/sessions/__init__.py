"""The session bus: cross-channel conversation context (see ``bus.py`` for the interface)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.errors import ConfigError
from .bus import Event, Session, SessionBus, SessionBusError, Turn, VarCaps, check_tenant
from .memory import MemoryBus

if TYPE_CHECKING:
    from ..config import Config
    from ..observability.metrics import Metrics

__all__ = [
    "Event",
    "MemoryBus",
    "Session",
    "SessionBus",
    "SessionBusError",
    "Turn",
    "build_bus",
    "check_tenants",
]


def check_tenants(config: Config) -> None:
    """Check every tenant the config names can key a session.

    Raises:
        ConfigError: naming the TOML key of a bad tenant.
    """
    named = [("server.default_tenant", config.server.default_tenant)]
    named += [(f"routes[{i}].tenant", r.tenant) for i, r in enumerate(config.routes) if r.tenant]
    for key, tenant in named:
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise ConfigError(f"{config.source}: key `{key}`: {exc}") from None


def build_bus(config: Config, metrics: Metrics | None = None) -> SessionBus:
    """The session bus ``[sessions] backend`` names (not yet opened).

    Raises:
        ConfigError: a tenant cannot key sessions, or the Redis URL is not usable.
    """
    check_tenants(config)
    cfg = config.sessions
    if cfg.backend == "memory":
        bus = MemoryBus(
            max_sessions=cfg.max_sessions,
            max_turns=cfg.max_turns,
            max_bytes=cfg.max_bytes,
            max_session_bytes=cfg.max_session_bytes,
            caps=VarCaps(cfg.max_vars_per_session, cfg.max_var_bytes_per_session),
        )
        if metrics is not None:
            metrics.watch_sessions(bus.held)  # the bus lives as long as the worker
        return bus
    from .redis_streams import RedisBus  # late: coredis is only needed for this backend

    try:
        return RedisBus(cfg, metrics)
    except ValueError as exc:
        raise ConfigError(f"{config.source}: key `sessions.url`: {exc}") from None
