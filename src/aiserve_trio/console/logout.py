"""Console tokens logged out before they expire: ``POST /admin/api/logout``.

A console token is stateless (an HMAC of its key, purpose and expiry, ``security/auth.py``:
any worker with the secret accepts it), so "Log out" used to clear the tab only and the
token stayed good for its 900 s (issue 55, item 2). :class:`Revoked` denies a logged-out
token until its expiry, checked by the gate after the token's signature:

- in this worker, a dict of the token's SHA-256 -> its expiry, at most
  :data:`MAX_REVOKED` entries, each dropped at the first logout after its token has
  expired (a revoked token
  past its expiry is refused as expired anyway). Full of live entries, a logout denies
  instead every console token of that key expiring no later than the one logged out
  (one entry per key: the key's other tabs log out too -- never a token left valid);
- with a Redis session bus (``[sessions] backend = "redis"``), also in that Redis
  (``{key_prefix}:console:revoked:{sha256}``, expiring with the token), so that every
  worker and host refuses it: each console-token request asks Redis (one ``EXISTS``,
  the page's 3 s polling). Redis away: the worker that took the logout refuses the
  token, the others do not learn of it until Redis answers (the logout says
  ``"shared": false``) -- a Redis outage does not lock operators out of the console.

Without Redis, several workers each keep their own list: a logout reaches the worker
that answered it, so set ``[sessions] backend = "redis"`` when console tokens must be
revocable across workers (with one worker, the list is enough).
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger("aiserve_trio.console")

#: Logged-out tokens kept per worker at most (each for at most the token's TTL).
MAX_REVOKED = 4096
#: Seconds a Redis call may take before the deny-list goes on without it.
REDIS_TIMEOUT_S = 0.5


def digest(token: str) -> str:
    """What is kept of a token: never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


class Revoked:
    """Console tokens logged out, until they expire (see the module docstring)."""

    def __init__(
        self, redis_url: str | None = None, prefix: str = "aiserve", *,
        max_entries: int = MAX_REVOKED,
    ) -> None:  # fmt: skip
        self._client: Any = None
        if redis_url is not None:
            from ..sessions.redis_streams import client_for_url  # late: coredis is optional

            self._client = client_for_url(redis_url, 2, REDIS_TIMEOUT_S)
        self._prefix = prefix
        self._stack: AsyncExitStack | None = None
        self.max_entries = max_entries
        #: Token digest -> its expiry (Unix seconds).
        self._tokens: dict[str, int] = {}
        #: Key id -> every console token of it expiring at or before this is denied
        #: (a full list's fallback: bounded by the number of keys).
        self._until: dict[str, int] = {}

    @classmethod
    def of(cls, config: Config) -> Revoked:
        sc = config.sessions
        if sc.backend == "redis":
            return cls(sc.url, sc.key_prefix)
        return cls()

    @property
    def shared(self) -> bool:
        return self._client is not None

    def __len__(self) -> int:
        return len(self._tokens)

    async def aopen(self) -> None:
        if self._client is not None:
            stack = AsyncExitStack()
            await stack.enter_async_context(self._client)
            self._stack = stack

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def _key(self, token_digest: str) -> str:
        return f"{self._prefix}:console:revoked:{token_digest}"

    def _drop_expired(self, now: float) -> None:
        for d in [d for d, expiry in self._tokens.items() if expiry < now]:
            del self._tokens[d]
        for k in [k for k, until in self._until.items() if until < now]:
            del self._until[k]

    async def add(self, token: str, key_id: str, expiry: int, now: float) -> bool:
        """Deny ``token`` (of ``key_id``, valid until ``expiry``) from now on.

        Returns:
            Whether every worker will refuse it (it reached Redis); False without Redis
            or when Redis did not answer (this worker refuses it all the same).
        """
        d = digest(token)
        self._drop_expired(now)  # at most max_entries: a logout is an operator's click
        if d in self._tokens or len(self._tokens) < self.max_entries:
            self._tokens[d] = expiry
        else:
            self._until[key_id] = max(self._until.get(key_id, 0), expiry)
            log.warning(
                "console: %d logged-out tokens held; every console token of %r issued "
                "until now is denied", len(self._tokens), key_id,
            )  # fmt: skip
        if self._client is None:
            return False
        done = await self._redis(
            lambda: self._client.set(self._key(d), key_id, exat=expiry + 1)
        )
        return bool(done)

    async def denied(self, token: str, key_id: str, expiry: int) -> bool:
        """Whether ``token`` (checked already: signed, not expired) was logged out."""
        if expiry <= self._until.get(key_id, -1):
            return True
        d = digest(token)
        if d in self._tokens:
            return True
        if self._client is None:
            return False
        found = await self._redis(lambda: self._client.exists([self._key(d)]))
        if found and len(self._tokens) < self.max_entries:
            self._tokens[d] = expiry  # the next request need not ask Redis
        return bool(found)

    async def _redis(self, call: Any) -> Any:
        """``call()``, or None when Redis fails or is slower than the timeout."""
        from coredis.exceptions import RedisError  # late: coredis only with Redis

        try:
            with trio.move_on_after(REDIS_TIMEOUT_S):
                return await call()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("console: the logged-out tokens' Redis cannot be reached: %s", exc)
        return None
