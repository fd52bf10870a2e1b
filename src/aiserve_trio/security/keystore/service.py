"""The worker's database keys: the in-memory table, kept fresh, and the changes admins
make (issue 47, items 1, 2 and 5).

**Propagation.** Every worker polls the change counter every :data:`POLL_S` (1 s): one
indexed ``SELECT`` of one row, off the event loop, and only when it moved, the rows past
the worker's ``rev`` (built into principals in the thread, applied to the table in one
step). A key created, changed, rotated or revoked on any worker of any host is therefore
seen by every worker within ``POLL_S`` plus one query (the stated bound: 1 s plus the
database's answer time); the worker that made the change applies it at once. With a
Redis session bus (``[sessions] backend = "redis"``) a change also bumps
``{key_prefix}:keys:rev`` there, which every worker reads every :data:`SIGNAL_S`
(0.1 s, one ``GET``): a change is then loaded within about 0.1 s plus one query, and
the database poll stays as the fallback when Redis is away.

**Outage.** A poll that fails keeps the last table serving (the gate never waits for the
database), sets ``aiserve_keys_db_up`` to 0, counts ``aiserve_keys_refresh_failures_total``
and says so in ``/healthz`` (``"keys": {"database": "unreachable", ...}``); a change asked
for meanwhile answers 503 ``keys_db_unavailable`` and changes nothing. When the database
answers again the next poll loads every change it missed: nothing is lost.

**Last use.** The gate notes a key's use in a dict (:attr:`KeyTable.used`); every
:data:`TOUCH_EVERY_S` the service writes those it holds in one transaction: never a write
per request, never on the loop.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio
from prometheus_client import Counter, Gauge

from ...core.errors import ConfigError, Conflict, Overloaded
from . import db
from .table import KeyTable

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ...config import Config

log = logging.getLogger("aiserve_trio.keys")
_T = TypeVar("_T")

#: Seconds between two polls of the change counter (the propagation bound without Redis).
POLL_S = 1.0
#: Seconds between two reads of the Redis change signal (with a Redis session bus).
SIGNAL_S = 0.1
#: Seconds a Redis call of the signal may take before it is given up.
SIGNAL_TIMEOUT_S = 0.5
#: What a Redis call of the signal that failed answers.
_FAILED: Any = object()
#: Seconds between two writes of the keys' last uses.
TOUCH_EVERY_S = 10.0
#: Seconds start-up waits for the first load before serving without it.
FIRST_LOAD_S = 5.0
#: Admin audit rows (of actions outside the key tables) kept while the database is away.
MAX_PENDING_AUDIT = 1000


class KeyService:
    """See the module docstring."""

    def __init__(
        self, connector: db.Connector, registry: CollectorRegistry | None = None,
        *, poll_s: float = POLL_S, redis_url: str | None = None, prefix: str = "aiserve",
    ) -> None:  # fmt: skip
        self.connector = connector
        self._redis: Any = None
        if redis_url is not None:
            from ...util.redisconn import client_for_url  # late: coredis is optional

            self._redis = client_for_url(redis_url, 8, SIGNAL_TIMEOUT_S)
        self._signal_key = f"{prefix}:keys:rev"
        #: The signal's last value read (``_FAILED``: none read yet).
        self._signal_seen: Any = _FAILED
        self.table = KeyTable()
        self.poll_s = poll_s
        self.rev = 0
        self._opened = False
        #: The database calls run one at a time in a thread (never Trio's shared limiter,
        #: whose threads resolve upstream host names).
        self._limiter = trio.CapacityLimiter(1)
        #: None until the first poll; then whether the last one reached the database.
        self.db_up: bool | None = None
        #: Unix time of the first failed poll of the current outage.
        self.down_since: float | None = None
        self.last_load: float | None = None
        self._pending_audit: list[tuple[Any, ...]] = []
        self._last_touch = time.time()
        self._scope: trio.CancelScope | None = None
        self._up: Gauge | None = None
        self._failures: Counter | None = None
        self._loaded: Gauge | None = None
        if registry is not None:
            self._up = Gauge(
                "aiserve_keys_db_up",
                "Whether the last poll of the database keys reached the database (0: the "
                "worker serves its last key table).",
                registry=registry,
            )
            self._failures = Counter(
                "aiserve_keys_refresh_failures",
                "Polls of the database keys that failed (the last table kept serving).",
                registry=registry,
            )
            self._loaded = Gauge(
                "aiserve_keys_loaded", "Database keys in this worker's table.", registry=registry
            )

    # --- the database, off the loop ---------------------------------------------

    async def _call(self, fn: Callable[[db.Exec], _T], *, write: bool) -> _T:
        create = not self._opened
        run = self.connector.run

        def job() -> _T:
            if create:
                run(db.migrate, write=True, create=True)
            return run(fn, write=write)  # type: ignore[no-any-return]

        result = await trio.to_thread.run_sync(job, limiter=self._limiter, abandon_on_cancel=True)
        self._opened = True
        return result

    async def read(self, fn: Callable[[db.Exec], _T]) -> _T:
        """A read for the admin API; 503 while the database is away."""
        try:
            return await self._call(fn, write=False)
        except Exception as exc:
            self._down(exc)
            raise self._unavailable("read") from None

    async def change(self, fn: Callable[[db.Exec], _T]) -> _T:
        """A change (one transaction with its audit row); applied here at once.

        Raises:
            Overloaded: ``keys_db_unavailable`` -- the database is away; nothing changed.
            Conflict: the change breaks a constraint (a key id taken).
        """
        try:
            result = await self._call(fn, write=True)
        except Exception as exc:
            if self.connector.is_conflict(exc):
                raise Conflict(f"the change conflicts with a stored record: {exc}") from None
            self._down(exc)
            raise self._unavailable("change") from None
        await self.refresh()
        await self._signal()
        return result

    async def _redis_call(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the signal's Redis; :data:`_FAILED` when it fails or is too slow."""
        from coredis.exceptions import RedisError  # late: coredis only with Redis

        try:
            with trio.move_on_after(SIGNAL_TIMEOUT_S):
                return await call()
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("keys: the change signal's Redis cannot be reached: %s", exc)
        return _FAILED

    async def _signal(self) -> None:
        """Tell every worker a change was made (with Redis); best effort."""
        if self._redis is not None:
            await self._redis_call(lambda: self._redis.incr(self._signal_key))

    async def _watch_signal(self) -> None:
        """Load at once when another worker signals a change (with Redis)."""
        while True:
            await trio.sleep(SIGNAL_S)
            seen = await self._redis_call(lambda: self._redis.get(self._signal_key))
            if seen is _FAILED:
                continue  # the database poll goes on meanwhile
            changed = self._signal_seen is not _FAILED and seen != self._signal_seen
            self._signal_seen = seen
            if changed:
                await self.refresh()

    @staticmethod
    def _unavailable(what: str) -> Overloaded:
        done = "nothing was changed" if what == "change" else "nothing was read"
        return Overloaded(
            f"the key database is unreachable: {done}; keys already issued keep working. "
            "Try again when it is back (see /healthz)",
            code="keys_db_unavailable",
        )

    async def refresh(self) -> bool:
        """Load what changed since the last load; False when the database is away."""
        try:
            rev, changed = await self._call(lambda ex: db.load(ex, self.rev), write=False)
        except Exception as exc:
            self._down(exc)
            return False
        if rev < self.rev:
            # Another database (or one restored from a backup): load it whole.
            rev, changed = await self._reload_all()
        self.table.apply(changed)
        self.rev = rev
        self._ok()
        return True

    async def _reload_all(self) -> tuple[int, dict[str, Any]]:
        rev, changed = await self._call(lambda ex: db.load(ex, -1), write=False)
        gone = {k: None for k in list(self.table.principals) if k not in changed}
        return rev, {**gone, **changed}

    def _down(self, exc: BaseException) -> None:
        if self.db_up is not False:
            log.warning(
                "keys: the database (%s) is unreachable: %s; the last key table keeps serving",
                self.connector, exc,
            )  # fmt: skip
            self.down_since = time.time()
        self.db_up = False
        if self._up is not None and self._failures is not None:
            self._up.set(0)
            self._failures.inc()

    def _ok(self) -> None:
        if self.db_up is False:
            log.warning("keys: the database (%s) answers again", self.connector)
        self.db_up = True
        self.down_since = None
        self.last_load = time.time()
        if self._up is not None and self._loaded is not None:
            self._up.set(1)
            self._loaded.set(len(self.table))

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` says of the key table."""
        state = {None: "starting", True: "ok", False: "unreachable"}[self.db_up]
        out: dict[str, Any] = {"database": state, "keys": len(self.table)}
        if self.down_since is not None:
            out["serving_table_from"] = self.last_load
            out["unreachable_since"] = self.down_since
        return out

    # --- the loop ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the table (start-up waits :data:`FIRST_LOAD_S` at most), then poll."""
        with trio.CancelScope() as scope:
            # Ended by :meth:`aclose` (the nursery it runs in may be its caller's).
            self._scope = scope
            with trio.move_on_after(FIRST_LOAD_S):
                await self.refresh()
            async with AsyncExitStack() as stack:
                if self._redis is not None:  # entered before the nursery, left after it
                    await stack.enter_async_context(self._redis)
                async with trio.open_nursery() as nursery:
                    if self._redis is not None:
                        nursery.start_soon(self._watch_signal)
                    task_status.started()
                    while True:
                        await trio.sleep(self.poll_s)
                        await self.refresh()
                        await self.flush()

    async def flush(self, force: bool = False) -> None:
        """Write the last uses (every :data:`TOUCH_EVERY_S`) and queued audit rows."""
        now = time.time()
        used = self.table.used
        if used and (force or now - self._last_touch >= TOUCH_EVERY_S):
            self.table.used = {}
            try:
                await self._call(lambda ex: db.touch(ex, used), write=True)
                self._last_touch = now
            except Exception as exc:
                self._down(exc)
                for k, ts in used.items():  # kept for the next try
                    self.table.used[k] = max(ts, self.table.used.get(k, 0.0))
        if self._pending_audit:
            rows, self._pending_audit = self._pending_audit, []

            def write(ex: db.Exec) -> None:
                for r in rows:
                    db.audit(ex, r)

            try:
                await self._call(write, write=True)
            except Exception as exc:
                self._down(exc)
                self._pending_audit = (rows + self._pending_audit)[-MAX_PENDING_AUDIT:]

    async def aclose(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        with trio.CancelScope(shield=True), trio.move_on_after(2.0):
            await self.flush(force=True)
            # PostgreSQL's connection, closed in the thread that uses it.
            await trio.to_thread.run_sync(self.connector.close, limiter=self._limiter)

    # --- the admin audit trail ----------------------------------------------------

    async def record(
        self, *, actor: str, tenant: str, client: str | None, action: str, target: str,
        detail: dict[str, Any],
    ) -> None:  # fmt: skip
        """Write one admin audit row for an action outside the key tables (a config
        reload, a chain edited, a budget changed); kept and written later when the
        database is away. ``detail`` must hold no secret."""
        row = audit_row(actor, tenant, client, action, target, detail)
        self._pending_audit.append(row)
        del self._pending_audit[:-MAX_PENDING_AUDIT]
        await self.flush()


def audit_row(
    actor: str, tenant: str, client: str | None, action: str, target: str,
    detail: dict[str, Any],
) -> tuple[Any, ...]:  # fmt: skip
    body = msgspec.json.encode(detail).decode()
    return (time.time(), actor, tenant, client, action, target, body)


def build_keys(config: Config, registry: CollectorRegistry | None = None) -> KeyService | None:
    """The worker's database keys: in the audit database (``[audit]``, SQLite or
    PostgreSQL) when auth is on; None when auth is off or there is no audit database.

    Raises:
        ConfigError: ``backend = "postgres"`` and the DSN's environment variable is unset.
    """
    auth, settings = config.auth, config.audit
    if auth is None or not auth.enabled or settings is None or settings.backend == "off":
        return None
    connector: db.Connector
    if settings.backend == "postgres":
        dsn = os.environ.get(settings.dsn_env)
        if not dsn:
            raise ConfigError(
                f"{config.source}: key `audit.dsn_env`: ${settings.dsn_env} is not set "
                "(the PostgreSQL DSN the database keys live in)"
            )
        connector = db.PostgresConnector(dsn, name=f"postgres (${settings.dsn_env})")
    else:
        path = Path(os.path.normpath(Path(config.base_dir) / settings.path))
        connector = db.SQLiteConnector(path)
    sc = config.sessions
    if sc.backend == "redis":
        return KeyService(connector, registry, redis_url=sc.url, prefix=sc.key_prefix)
    return KeyService(connector, registry)
