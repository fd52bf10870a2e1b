"""The endpoint table: path, methods, who may call, what admission it takes, and the handler.

One table serves both the router (which handler runs) and the gate (what
authentication and which admission slot the request needs), so a path rule is
written once. Paths are exact (``/v1/models``) or templates with one-segment
parameters (``/v1/sessions/{id}/events``).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.errors import GatewayError, MethodNotAllowed, NotFound
from .responder import ErrorShape, Responder
from .types import Receive, Scope

if TYPE_CHECKING:
    from ..security.auth import Principal


class Auth(enum.Enum):
    """Who may call an endpoint (when auth is on)."""

    #: Anyone (probes).
    OPEN = "open"
    #: Anyone, or admin keys only: ``[auth] metrics`` decides.
    METRICS = "metrics"
    #: Any valid key.
    KEY = "key"
    #: A key that may read sessions, or a stream token for the session in the path
    #: (``EventSource``).
    KEY_OR_STREAM_TOKEN = "key_or_stream_token"
    #: An admin key.
    ADMIN = "admin"
    #: An admin key, or a console token an admin key was exchanged for (the operator console).
    ADMIN_OR_CONSOLE_TOKEN = "admin_or_console_token"
    #: A key allowed on this chat route; counts against the key's rate limit.
    CHAT = "chat"
    #: A key that may read its tenant's sessions (``Principal.check_sessions``).
    SESSION_READ = "session_read"
    #: A key that may change its tenant's sessions.
    SESSION_WRITE = "session_write"


class Admission(enum.Enum):
    """Which per-worker slot a request holds while it runs."""

    #: None (probes and metrics must answer under overload).
    NONE = "none"
    #: One of ``limits.max_inflight`` request slots.
    REQUEST = "request"
    #: A request slot and, for its whole life, one of ``limits.max_streams`` stream slots.
    STREAM = "stream"


@dataclass(slots=True)
class Request:
    """One HTTP request as a handler sees it (read-only after the gate has run)."""

    scope: Scope
    method: str
    path: str
    #: Request headers, names lower-cased (last value wins).
    headers: dict[str, str]
    receive: Receive
    responder: Responder
    #: ``trio.current_time()`` when the request arrived (deadlines count from here).
    arrival: float
    #: The path's template parameters, e.g. ``{"id": "s-42"}``.
    params: dict[str, str] = field(default_factory=dict)
    #: Who the request acts as; None on open paths or when auth is off.
    principal: Principal | None = None


Handler = Callable[[Request], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    methods: tuple[str, ...]
    auth: Auth
    admission: Admission
    handler: Handler
    #: Metric-safe name (``chat`` endpoints use their route's label).
    name: str = ""
    #: How its errors look when its API is not OpenAI's (``apis/``).
    errors: ErrorShape | None = None
    #: ``Auth.CHAT``: the route whose keys may call it, when not its own path (a
    #: Messages route's ``count_tokens`` is its route's).
    route: str | None = None

    def segments(self) -> tuple[str, ...]:
        return tuple(self.path.strip("/").split("/"))


class EndpointTable:
    """Resolves ``(method, path)`` to an endpoint and its path parameters.

    A request no endpoint serves still passes the gate before it hears 404 or
    405 (so the answer does not tell a caller without a key which paths
    exist): it resolves to a stand-in endpoint that takes a request slot,
    needs what ``unknown`` says for its path prefix (default: any key), and
    whose handler raises the 404 or 405.
    """

    def __init__(
        self, endpoints: Iterable[Endpoint], unknown: Iterable[tuple[str, Auth]] = ()
    ) -> None:
        self._unknown = tuple(unknown)
        self._exact: dict[str, Endpoint] = {}
        self._templates: list[tuple[tuple[str, ...], Endpoint]] = []
        for ep in endpoints:
            if "{" in ep.path:
                self._templates.append((ep.segments(), ep))
            elif ep.path in self._exact:
                raise ValueError(f"two endpoints serve {ep.path!r}")
            else:
                self._exact[ep.path] = ep

    def __iter__(self) -> Iterator[Endpoint]:
        yield from self._exact.values()
        for _, ep in self._templates:
            yield ep

    def resolve(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]]:
        """The endpoint serving ``method path`` and the path's parameters.

        A path no endpoint serves, or a method it does not take, resolves to a
        stand-in whose handler raises :class:`NotFound` or
        :class:`MethodNotAllowed` (with ``Allow``).
        """
        ep = self._exact.get(path)
        params: dict[str, str] = {}
        if ep is None:
            found = self._template(path)
            if found is None:
                auth = next((a for p, a in self._unknown if path.startswith(p)), Auth.KEY)
                missing = NotFound(f"no route serves {method} {path[:200]}")
                return _refusal(path, auth, missing), params
            ep, params = found
        if method not in ep.methods:
            allowed = ", ".join(ep.methods)
            refused: GatewayError = MethodNotAllowed(
                f"{method} is not allowed on {path[:200]}; use {allowed}",
                headers={"Allow": allowed},
            )
            # A chat route's rate limit is not charged for a wrong method.
            auth = Auth.KEY if ep.auth is Auth.CHAT else ep.auth
            return _refusal(path, auth, refused), params
        return ep, params

    def _template(self, path: str) -> tuple[Endpoint, dict[str, str]] | None:
        parts = path.strip("/").split("/")
        for segments, ep in self._templates:
            if len(segments) != len(parts):
                continue
            params: dict[str, str] = {}
            for want, got in zip(segments, parts, strict=True):
                if want.startswith("{"):
                    if not got:
                        break
                    params[want[1:-1]] = got
                elif want != got:
                    break
            else:
                return ep, params
        return None


def _refusal(path: str, auth: Auth, err: GatewayError) -> Endpoint:
    async def refuse(request: Request) -> None:
        raise err

    return Endpoint(path, (), auth, Admission.REQUEST, refuse, name="refused")
