"""Reading usage back: ``GET /admin/usage`` (admin: everyone's) and ``GET /v1/usage``
(the caller's own key), totals of requests, tokens and cost from the audit log.

``from`` and ``to`` are ``YYYY-MM-DD`` (UTC days; ``to`` is inclusive) or Unix
seconds, from 1970-01-01 up to the end of 9999-12-30 (a value outside, or not a date,
is a 400 in the error envelope); the default is the last 30 days. ``group_by`` is
``tenant``, ``key``, ``model`` (the model that answered), ``route`` or ``day``. :func:`parse_query`
and :func:`usage_sql` are pure; the handlers run the query in a thread of the
audit log's readers (:meth:`AuditLog.query`: a 503 with ``Retry-After`` in the
error envelope when they are all busy or the database is away).

``/v1/usage`` reads the rows of the caller's key *in the caller's tenant*: a key id
given again in another tenant never reads the rows of the key that had it before.

``requests`` is the sum of the rows' ``requests`` column: a row is one request, or an
interval's wrong-key requests from one address (``log.py``).

An answer that may be short says so: while rows this worker queued before the
read are not written yet (the database is away) or once it has dropped rows,
the body has ``"partial": true`` and ``"unwritten_rows"`` (how many), and the
response the header ``X-Aiserve-Usage-Partial`` with the same count. Rows
another worker has not written are that worker's to report.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from ..core.api import encoder
from ..core.errors import BadRequest, NotFound
from ..http.types import JSON_HEADERS, Headers
from ..observability.debug import query_params

if TYPE_CHECKING:
    from ..http.endpoints import Request
    from .log import AuditLog

GROUPS = {
    "tenant": "tenant",
    "key": "key_id",
    "model": "served_model",
    "route": "route",
    "day": None,  # the database's own day expression
}
DEFAULT_DAYS = 30
DAY_S = 86_400.0
#: The last instant a query may name (the end of 9999-12-30, UTC): past it, the day
#: after ``to`` is not a date Python can write.
MAX_TS = dt.datetime(9999, 12, 31, tzinfo=dt.UTC).timestamp()
#: Groups returned at most (a day per row for ten years, or every key of a big bank).
MAX_GROUPS = 5_000


@dataclass(frozen=True, slots=True)
class UsageQuery:
    start: float
    end: float
    group_by: str
    #: Only this key's rows (``/v1/usage``); "" means rows without a key (auth off).
    key_id: str | None = None
    #: Only this tenant's rows (``/v1/usage``: the key's own tenant).
    tenant: str | None = None


class Totals(msgspec.Struct, kw_only=True):
    requests: int = 0
    #: Every input token, those the backend read from or wrote to its prompt cache too.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    saved: float = 0.0
    #: Of ``prompt_tokens``: read from the backend's prompt cache, written to it.
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    #: The part of ``cost`` paid for those reads and writes.
    cache_cost: float = 0.0


class Group(Totals, kw_only=True):
    group: str | None


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    start: str
    end: str
    group_by: str
    currency: str
    groups: list[Group]
    total: Totals
    key: str | None = None
    #: Rows of this worker missing from the totals (not written yet, or dropped).
    partial: bool = False
    unwritten_rows: int = 0


def _time(value: str, name: str, *, end: bool) -> float:
    bad = BadRequest(
        f"`{name}` must be a date (YYYY-MM-DD) or Unix seconds between 1970-01-01 and "
        f"9999-12-30; got {value[:40]!r}",
        param=name,
        code="invalid_time",
    )
    try:
        if value.replace(".", "", 1).isdigit():
            ts = float(value)
        else:
            day = dt.date.fromisoformat(value)
            ts = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp()
            if ts < 0.0:
                raise bad
            ts = ts + DAY_S if end else ts  # `to` is the whole day
    except (ValueError, OverflowError):
        raise bad from None
    if not 0.0 <= ts <= MAX_TS:  # inf from a long string of digits too
        raise bad
    return ts


def parse_query(q: Mapping[str, str], now: float) -> UsageQuery:
    """The query of a usage request (``q``: its query string's parameters).

    Raises:
        BadRequest: an unknown ``group_by``, a bad ``from``/``to``, or ``from`` after ``to``.
    """
    group_by = q.get("group_by", "day")
    if group_by not in GROUPS:
        raise BadRequest(
            f"`group_by` must be one of {', '.join(GROUPS)}; got {group_by[:40]!r}",
            param="group_by",
            code="invalid_group_by",
        )
    end = _time(q["to"], "to", end=True) if "to" in q else now
    start = _time(q["from"], "from", end=False) if "from" in q else end - DEFAULT_DAYS * DAY_S
    if start > end:
        raise BadRequest("`from` is after `to`", param="from", code="invalid_time")
    return UsageQuery(start=start, end=end, group_by=group_by)


def usage_sql(query: UsageQuery, placeholder: str, day_sql: str) -> tuple[str, list[Any]]:
    """The SQL (and its parameters) of ``query`` for a database with ``placeholder``."""
    group = GROUPS[query.group_by] or day_sql
    where = f"ts >= {placeholder} AND ts < {placeholder}"
    params: list[Any] = [query.start, query.end]
    if query.key_id is not None:
        if query.key_id:
            where += f" AND key_id = {placeholder}"
            params.append(query.key_id)
        else:
            where += " AND key_id IS NULL"
    if query.tenant is not None:
        where += f" AND tenant = {placeholder}"
        params.append(query.tenant)
    sql = (
        f"SELECT {group} AS g, coalesce(sum(requests), 0), coalesce(sum(prompt_tokens), 0), "
        f"coalesce(sum(completion_tokens), 0), coalesce(sum(cost), 0), "
        f"coalesce(sum(saved), 0), coalesce(sum(cache_read_tokens), 0), "
        f"coalesce(sum(cache_write_tokens), 0), coalesce(sum(cache_cost), 0) "
        f"FROM audit_requests WHERE {where} "
        f"GROUP BY {group} ORDER BY g LIMIT {MAX_GROUPS}"
    )
    return sql, params


def summarise(query: UsageQuery, rows: list[tuple[Any, ...]], currency: str) -> Usage:
    """The JSON body of ``rows`` (one per group)."""
    groups = [
        Group(
            group=None if g is None else str(g),
            requests=int(n),
            prompt_tokens=int(p),
            completion_tokens=int(c),
            cost=round(float(cost), 10),
            saved=round(float(saved), 10),
            cache_read_tokens=int(read),
            cache_write_tokens=int(written),
            cache_cost=round(float(cache_cost), 10),
        )
        for g, n, p, c, cost, saved, read, written, cache_cost in rows
    ]
    total = Totals(
        requests=sum(g.requests for g in groups),
        prompt_tokens=sum(g.prompt_tokens for g in groups),
        completion_tokens=sum(g.completion_tokens for g in groups),
        cost=round(sum(g.cost for g in groups), 10),
        saved=round(sum(g.saved for g in groups), 10),
        cache_read_tokens=sum(g.cache_read_tokens for g in groups),
        cache_write_tokens=sum(g.cache_write_tokens for g in groups),
        cache_cost=round(sum(g.cache_cost for g in groups), 10),
    )
    return Usage(
        start=_iso(query.start),
        end=_iso(query.end),
        group_by=query.group_by,
        currency=currency,
        groups=groups,
        total=total,
        key=query.key_id,
    )


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


class UsageEndpoints:
    """The two usage handlers, reading the app's audit log (None: it is off)."""

    def __init__(self, audit: AuditLog | None, currency: str) -> None:
        self.audit = audit
        self.currency = currency

    async def read(self, query: UsageQuery) -> Usage:
        """Totals for ``query``.

        Raises:
            NotFound: the audit log is off (usage is read from it).
        """
        audit = self.audit
        if audit is None:
            raise NotFound(
                "usage is read from the audit log, which is off: add [audit]", code="audit_off"
            )
        mark = audit.offered
        await audit.flush()  # the requests made before this read are in it
        sql, params = usage_sql(query, audit.db.placeholder, audit.db.day_sql)
        usage = summarise(query, await audit.query(sql, params), self.currency)
        unwritten = audit.unwritten(mark)
        if unwritten:
            usage.partial = True
            usage.unwritten_rows = unwritten
        return usage

    async def admin(self, request: Request) -> None:
        """``GET /admin/usage``: every tenant's and key's usage for a ``global_admin`` key
        (or with auth off); its own tenant's for an admin key of one tenant."""
        query = parse_query(query_params(request), time.time())
        p = request.principal
        if p is not None and p.admin_tenant is not None:
            query = UsageQuery(query.start, query.end, query.group_by, tenant=p.admin_tenant)
        await _answer(request, await self.read(query))

    async def own(self, request: Request) -> None:
        """``GET /v1/usage``: the calling key's usage in its tenant (with auth off: requests
        without a key)."""
        query = parse_query(query_params(request), time.time())
        p = request.principal
        query = UsageQuery(
            query.start,
            query.end,
            query.group_by,
            p.key_id if p else "",
            tenant=p.tenant if p else None,
        )
        await _answer(request, await self.read(query))


async def _answer(request: Request, usage: Usage) -> None:
    headers: Headers = JSON_HEADERS
    if usage.partial:
        headers = [*JSON_HEADERS, (b"x-aiserve-usage-partial", str(usage.unwritten_rows).encode())]
    await request.responder.complete(200, headers, encoder.encode(usage))


#: The column a budget's scope is kept under in the audit rows.
_SCOPES = {"key": "key_id", "tenant": "tenant"}


async def period_spend(
    audit: AuditLog, scope: str, name: str | None, start: float, end: float
) -> dict[str, float]:
    """The cost the audit log holds for each key (``scope = "key"``, named
    ``tenant/key``) or tenant of a budget period, ``start <= ts < end``: only ``name``'s,
    or every one's (at most
    :data:`MAX_GROUPS`). The spend ledger re-seeds a period it lost from this
    (``spend/ledger.py``): it is the one record of spend that outlives a Redis flush or
    a worker's restart.

    This worker's queued rows are written first (:meth:`AuditLog.flush`), so a charge
    made before the call is in the sum. One bounded query in a thread of the usage
    reads' own limiter (ended by the database after ``usage_timeout_ms``).

    Raises:
        Overloaded: the readers are busy or the database is away (the ledger tries again).
    """
    p = audit.db.placeholder
    where = f"ts >= {p} AND ts < {p}"
    params: list[Any] = [start, end]
    if scope == "key":
        # A key is its tenant's: ``tenant/key`` (a key id given again in another tenant
        # is another key, and reads none of the old one's spend).
        if name is not None:
            tenant, _, key_id = name.partition("/")
            where += f" AND tenant = {p} AND key_id = {p}"
            params += [tenant, key_id]
        sql = (
            f"SELECT tenant, key_id, coalesce(sum(cost), 0) FROM audit_requests "
            f"WHERE {where} AND key_id IS NOT NULL GROUP BY tenant, key_id LIMIT {MAX_GROUPS}"
        )
        await audit.flush()
        rows = await audit.query(sql, params)
        return {f"{t}/{k}": float(cost) for t, k, cost in rows}
    column = _SCOPES[scope]
    if name is not None:
        where += f" AND {column} = {p}"
        params.append(name)
    sql = (
        f"SELECT {column}, coalesce(sum(cost), 0) FROM audit_requests WHERE {where} "
        f"AND {column} IS NOT NULL GROUP BY {column} LIMIT {MAX_GROUPS}"
    )
    await audit.flush()
    rows = await audit.query(sql, params)
    return {str(g): float(cost) for g, cost in rows}
