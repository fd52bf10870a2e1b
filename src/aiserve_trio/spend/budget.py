"""Budgets per API key and per tenant: calendar periods and the check (pure: no I/O).

A budget is an amount in ``[pricing] currency`` per ``budget_period``: ``day``,
``week`` (from Monday), ``month`` -- calendar periods in UTC -- or ``total``
(never resets). Spend is charged when a request ends (its cost is known only
then), and a request is admitted while its key's and its tenant's spend for
the current period are below their budgets.

Reservations (issue 50, item 4): an admitted request holds its maximum cost
(:class:`Reserve`) against its budgets until it ends, when its real cost is charged
and the hold let go; a request is admitted while spend + holds is below the budget.
So however many streams a client opens at once, only one is admitted on the last
part of a budget, and the spend ends below the budget plus the cost of the last
request admitted -- plus, where a route's ``budget_reserve`` held less than a request
cost, the difference for each request then in flight. The holds are this worker's:
other workers' requests in flight add to the bound what they cost.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.errors import BudgetExceeded
from .prices import dearest, served_models

if TYPE_CHECKING:
    from ..config import Config
    from .settings import Period


@dataclass(frozen=True, slots=True)
class Window:
    """One period of a budget: its name in ledger keys, when it ends and when it began
    (Unix seconds; the start is where a re-seed from the audit log sums from)."""

    name: str
    resets_at: float
    starts_at: float = 0.0


def window(period: Period, now: float) -> Window:
    """The period containing Unix time ``now``."""
    if period == "total":
        return Window("total", math.inf, 0.0)
    day = dt.datetime.fromtimestamp(now, dt.UTC).date()
    if period == "day":
        start, end = day, day + dt.timedelta(days=1)
        name = start.isoformat()
    elif period == "week":
        start = day - dt.timedelta(days=day.weekday())
        end = start + dt.timedelta(days=7)
        iso = start.isocalendar()
        name = f"{iso.year}-W{iso.week:02d}"
    else:
        start = day.replace(day=1)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        name = f"{start.year}-{start.month:02d}"
    resets = dt.datetime(end.year, end.month, end.day, tzinfo=dt.UTC).timestamp()
    starts = dt.datetime(start.year, start.month, start.day, tzinfo=dt.UTC).timestamp()
    return Window(name, resets, starts)


@dataclass(frozen=True, slots=True)
class Limit:
    """One budget: ``scope`` is ``key`` or ``tenant``, ``name`` the key id or tenant;
    a key's budget also names the key's ``tenant``."""

    scope: str
    name: str
    amount: float
    period: Period
    alert_at: float
    tenant: str | None = None

    @property
    def label(self) -> str:
        return f"{self.scope}:{self.name}"

    @property
    def who(self) -> str:
        """Whose spend it is, in the ledger and the audit log's sums: a key as
        ``tenant/key`` (a key id given again in another tenant is another key and
        inherits nothing -- neither name can hold a ``/``), a tenant by its name."""
        return self.name if self.tenant is None else f"{self.tenant}/{self.name}"

    def slot(self, now: float) -> tuple[str, Window]:
        """The ledger key of the current period, and the period."""
        w = window(self.period, now)
        return f"{self.scope}:{self.who}:{w.name}", w


@dataclass(frozen=True, slots=True)
class Reserve:
    """What one request of a route holds against its budgets while it runs: its maximum
    cost, known before its body is read -- every byte of the body a prompt token (a
    token is at least one byte) at the dearest prompt rate of the route's models, plus
    the route's ``max_tokens`` cap at the dearest completion rate -- at most ``cap``
    (the route's ``budget_reserve``)."""

    prompt_rate: float
    completion_rate: float
    max_tokens: int
    max_body_bytes: int
    cap: float | None = None

    def amount(self, body_bytes: int | None) -> float:
        """The hold of a request whose body declares ``body_bytes`` (None: not declared,
        at most ``max_body_bytes``)."""
        size = self.max_body_bytes if body_bytes is None else min(body_bytes, self.max_body_bytes)
        most = size * self.prompt_rate + self.max_tokens * self.completion_rate
        return most if self.cap is None else min(most, self.cap)


def route_reserves(config: Config) -> dict[str, Reserve]:
    """What one request of each route (by path) holds against its budgets: its maximum
    cost at the dearest rates of the models its adapters (and steps') may answer with."""
    lim = config.limits
    out = {}
    for route in config.routes:
        steps = [a for step in route.steps if (a := getattr(step, "adapter", None))]
        names = [route.adapter, *route.adapters, *steps]
        rates = dearest(config, served_models(config, names))
        most = 0 if route.kind == "embeddings" else route.max_tokens or lim.max_tokens
        out[route.path] = Reserve(*rates, most, lim.max_body_bytes, route.budget_reserve)
    return out


class Budgets:
    """The budgets of one config, by key id and by tenant."""

    def __init__(self, keys: dict[str, Limit], tenants: dict[str, Limit]) -> None:
        self.keys = keys
        self.tenants = tenants

    @classmethod
    def of(cls, config: Config) -> Budgets:
        keys = {
            k.id: Limit("key", k.id, k.budget, k.budget_period, k.budget_alert_at, k.tenant)
            for k in (config.auth.keys if config.auth is not None else [])
            if k.budget is not None
        }
        tenants = {
            name: Limit("tenant", name, t.budget, t.budget_period, t.budget_alert_at)
            for name, t in config.tenants.items()
            if t.budget is not None
        }
        return cls(keys, tenants)

    def __bool__(self) -> bool:
        return bool(self.keys or self.tenants)

    def limits(self, key_id: str | None, tenant: str) -> list[Limit]:
        """The budgets a request of ``key_id`` for ``tenant`` counts against."""
        out = []
        if key_id is not None and (k := self.keys.get(key_id)) is not None:
            out.append(k)
        if (t := self.tenants.get(tenant)) is not None:
            out.append(t)
        return out


def _text(amount: float) -> str:
    return f"{amount:.6f}".rstrip("0").rstrip(".")


def check(
    limits: list[Limit], spent: list[float], now: float, currency: str,
    held: list[float] | None = None,
) -> None:
    """Refuse a request once one of its budgets is spent, or held by requests in flight.

    Args:
        spent: the spend of each limit's current period, in the same order.
        held: what the requests in flight hold against each (their maximum cost).

    Raises:
        BudgetExceeded: naming the first budget that is spent and when it resets, or
            that requests in flight hold the rest of it.
    """
    holds = held if held is not None else [0.0] * len(limits)
    for limit, used, hold in zip(limits, spent, holds, strict=True):
        if used + hold < limit.amount:
            continue
        whose = f"API key {limit.name!r}" if limit.scope == "key" else f"tenant {limit.name!r}"
        if used < limit.amount:
            raise BudgetExceeded(
                f"the {limit.period} budget of {whose} ({limit.amount:g} {currency}) is held "
                f"by its requests in flight ({_text(used)} {currency} spent, {_text(hold)} "
                f"{currency} reserved for their maximum cost); retry when they end",
                param=limit.label,
                headers={"Retry-After": "1"},
            )
        w = window(limit.period, now)
        spent_text = _text(used)
        if math.isinf(w.resets_at):
            when = "it does not reset (budget_period = total)"
            headers = {}
        else:
            stamp = dt.datetime.fromtimestamp(w.resets_at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            when = f"it resets at {stamp}"
            headers = {"Retry-After": str(max(1, math.ceil(w.resets_at - now)))}
        raise BudgetExceeded(
            f"the {limit.period} budget of {whose} ({limit.amount:g} {currency}) is spent "
            f"({spent_text} {currency}); {when}",
            param=limit.label,
            headers=headers,
        )
