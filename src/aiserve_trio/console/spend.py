"""The console's Spend page: spend per day, by tenant, key and model (from the audit log),
and every budget with its use (from the spend ledger)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import msgspec

from ..audit.usage import DAY_S, Group, UsageQuery

if TYPE_CHECKING:
    from ..audit.usage import UsageEndpoints
    from ..security.gate import Gate

#: Days the chart covers.
DAYS = 30


class BudgetUse(msgspec.Struct, kw_only=True):
    scope: str
    name: str
    amount: float
    period: str
    spent: float
    ratio: float
    alert_at: float
    #: ISO time of the next reset; None for a ``total`` budget.
    resets_at: str | None


class Spend(msgspec.Struct, kw_only=True):
    currency: str
    #: False: the audit log is off, so there are no days or tables to show.
    audit: bool
    days: list[Group]
    tenants: list[Group]
    keys: list[Group]
    models: list[Group]
    budgets: list[BudgetUse]


async def spend_view(
    usage: UsageEndpoints | None,
    gate: Gate,
    now: float | None = None,
    tenant: str | None = None,
    keys: frozenset[str] = frozenset(),
) -> Spend:
    """What the Spend page shows (the last :data:`DAYS` days; no tables without the log):
    every tenant's, or ``tenant``'s only (an admin of one tenant: its rows, its budget and
    its ``keys``' budgets)."""
    now = time.time() if now is None else now
    start = (math.floor(now / DAY_S) - DAYS + 1) * DAY_S
    tables: dict[str, list[Group]] = {"day": [], "tenant": [], "key": [], "model": []}
    if usage is not None and usage.audit is not None:
        for group_by in tables:
            query = UsageQuery(start=start, end=now + 1, group_by=group_by, tenant=tenant)
            got = await usage.read(query)
            tables[group_by] = got.groups
    limits = [*gate.budgets.keys.values(), *gate.budgets.tenants.values()]
    if tenant is not None:
        mine = {"key": keys, "tenant": frozenset({tenant})}
        limits = [limit for limit in limits if limit.name in mine[limit.scope]]
    spent = await gate.ledger.spent(limits, now) if limits else []
    budgets = []
    for limit, used in zip(limits, spent, strict=True):
        resets = limit.slot(now)[1].resets_at
        budgets.append(
            BudgetUse(
                scope=limit.scope,
                name=limit.name,
                amount=limit.amount,
                period=limit.period,
                spent=round(used, 10),
                ratio=round(used / limit.amount, 6) if limit.amount > 0 else 1.0,
                alert_at=limit.alert_at,
                resets_at=None if math.isinf(resets) else time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(resets)
                ),
            )
        )
    return Spend(
        currency=gate.currency,
        audit=usage is not None and usage.audit is not None,
        days=tables["day"],
        tenants=tables["tenant"],
        keys=tables["key"],
        models=tables["model"],
        budgets=budgets,
    )
