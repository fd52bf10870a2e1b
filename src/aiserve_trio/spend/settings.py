"""``[pricing]`` and ``[tenants.NAME]``: prices per model and tenant budgets; validated at load.

::

    [pricing]
    currency = "USD"
    [pricing.models."aiserve-mock"]
    input_per_mtok = 3.0          # per million prompt tokens
    output_per_mtok = 15.0        # per million completion tokens
    cache_read_per_mtok = 0.3     # prompt tokens read from the backend's prompt cache
    cache_write_per_mtok = 3.75   # prompt tokens written to it (Anthropic's cache creation)
    reasoning_per_mtok = 15.0     # reasoning tokens (default: output_per_mtok)

Cache reads and writes default to ``input_per_mtok``: without its own rate a cached
token costs what an uncached one does (as before cached tokens were counted; an
Anthropic cache write costs 1.25x the input rate, so give it). No provider's multiplier
is built in: the table says each.
``cached_input_per_mtok`` is the older name of ``cache_read_per_mtok``.

    [tenants.bank]
    budget = 100.0                # in `currency`
    budget_period = "month"       # day, week, month (calendar, UTC) or total
    budget_alert_at = 0.8         # aiserve_budget_used_ratio alerts from here

Leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..core.decoding import field_error

Period = Literal["day", "week", "month", "total"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Like the config's sections: an unknown key is an error."""


class ModelPrice(_Section):
    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0
    #: Prompt tokens read from the backend's prompt cache. Default: ``input_per_mtok``
    #: (no discount).
    cache_read_per_mtok: float | None = None
    #: Prompt tokens written to the backend's prompt cache. Default: ``input_per_mtok``.
    cache_write_per_mtok: float | None = None
    #: The older name of ``cache_read_per_mtok`` (one or the other).
    cached_input_per_mtok: float | None = None
    #: Default: ``output_per_mtok``.
    reasoning_per_mtok: float | None = None

    def __post_init__(self) -> None:
        for key in ("input_per_mtok", "output_per_mtok", "cache_read_per_mtok",
                    "cache_write_per_mtok", "cached_input_per_mtok", "reasoning_per_mtok"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise field_error(key, "must not be negative")
        if self.cached_input_per_mtok is not None:
            if self.cache_read_per_mtok is not None:
                raise field_error(
                    "cached_input_per_mtok", "is the older name of cache_read_per_mtok: set one"
                )
            self.cache_read_per_mtok = self.cached_input_per_mtok


class PricingConfig(_Section):
    currency: str = "USD"
    #: Prices by model name, as clients and adapters' ``models`` name them.
    models: dict[str, ModelPrice] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (3 <= len(self.currency) <= 8 and self.currency.isalnum()):
            raise field_error("currency", "must be a currency code such as USD")


class BudgetFields(_Section):
    """A budget: on ``[[auth.keys]]`` and ``[tenants.NAME]``."""

    #: In ``[pricing] currency``; None: no budget.
    budget: float | None = None
    budget_period: Period = "month"
    #: The used share from which ``aiserve_budget_used_ratio`` should alert.
    budget_alert_at: float = 0.8

    def __post_init__(self) -> None:
        check_budget(self.budget, self.budget_alert_at)


class TenantConfig(BudgetFields):
    #: The MCP tools this tenant's keys may be granted at most (``server/tool``,
    #: ``server/*``; mcp/grants.py); unset: no ceiling beyond each key's own grant.
    mcp_tools: list[str] | None = None


#: Days of audit rows a budget period's re-seed reads at most (a month: 31).
PERIOD_DAYS: dict[str, int] = {"day": 1, "week": 7, "month": 31}


def unkept(budgets: list[tuple[str, str, Period]], retention_days: int) -> str | None:
    """Why one of ``budgets`` (scope, key id or tenant, period) could not be kept by a
    memory ledger whose audit log keeps ``retention_days`` (0: every row), or None.

    Without Redis, the audit rows are the only record of a period's spend that outlives
    a worker (each worker seeds its ledger from them at start and reads them to see the
    others' spend): a retention shorter than a budget's period deletes rows the budget
    still counts, so a restart would give that spend back. A ``total`` budget needs
    every row.
    """
    if retention_days == 0:
        return None
    for scope, name, period in budgets:
        need = PERIOD_DAYS.get(period)
        if need is not None and retention_days >= need:
            continue
        whose = f"API key {name!r}" if scope == "key" else f"tenant {name!r}"
        wanted = "0 (every row kept)" if need is None else f"at least {need} (or 0)"
        return (
            f"{retention_days} deletes audit rows the {period} budget of {whose} still "
            "counts: without Redis a worker reads a budget's spend back from the audit log "
            f"at start, so a restart would forget it; set retention_days = {wanted}, or "
            'keep spend in Redis ([sessions] backend = "redis")'
        )
    return None


def check_budget(budget: float | None, alert_at: float) -> None:
    if budget is not None and budget < 0:
        raise field_error("budget", "must not be negative")
    if not 0.0 < alert_at <= 1.0:
        raise field_error("budget_alert_at", "must be in (0, 1]")
