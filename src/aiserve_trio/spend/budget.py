"""Budgets per API key and per tenant: calendar periods and the check (pure: no I/O).

A budget is an amount in ``[pricing] currency`` per ``budget_period``: ``day``,
``week`` (from Monday), ``month`` -- calendar periods in UTC -- or ``total``
(never resets). Spend is charged when a request ends (its cost is known only
then), and a request is admitted while its key's and its tenant's spend for
the current period are below their budgets.

Overshoot: every request admitted while the spend was below the budget is
served and charged, so the spend can pass the budget by at most what the
requests in flight at the moment it crossed cost (each at most its
``max_tokens`` at the served model's price). Nothing is reserved up front: a
reservation would refuse requests on estimates the gateway cannot make.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BudgetExceeded

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
    """One budget: ``scope`` is ``key`` or ``tenant``, ``name`` the key id or tenant."""

    scope: str
    name: str
    amount: float
    period: Period
    alert_at: float

    @property
    def label(self) -> str:
        return f"{self.scope}:{self.name}"

    def slot(self, now: float) -> tuple[str, Window]:
        """The ledger key of the current period, and the period."""
        w = window(self.period, now)
        return f"{self.scope}:{self.name}:{w.name}", w


class Budgets:
    """The budgets of one config, by key id and by tenant."""

    def __init__(self, keys: dict[str, Limit], tenants: dict[str, Limit]) -> None:
        self.keys = keys
        self.tenants = tenants

    @classmethod
    def of(cls, config: Config) -> Budgets:
        keys = {
            k.id: Limit("key", k.id, k.budget, k.budget_period, k.budget_alert_at)
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


def check(limits: list[Limit], spent: list[float], now: float, currency: str) -> None:
    """Refuse a request once one of its budgets is spent.

    Args:
        spent: the spend of each limit's current period, in the same order.

    Raises:
        BudgetExceeded: naming the first budget that is spent and when it resets.
    """
    for limit, used in zip(limits, spent, strict=True):
        if used < limit.amount:
            continue
        w = window(limit.period, now)
        whose = f"API key {limit.name!r}" if limit.scope == "key" else f"tenant {limit.name!r}"
        spent_text = f"{used:.6f}".rstrip("0").rstrip(".")
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
