"""Clients of the upstream MCP servers: a stdio child process, or a Streamable HTTP server.

Each speaks JSON-RPC with msgspec (no pydantic models on the call path) and keeps
what the gateway lists -- the server's tools, prompts and resources, fetched page by
page after the handshake and again when the server says its list changed.

An :class:`Upstream` runs in a task of the hub (:meth:`Upstream.run`): a stdio server
is started, handshaken, listed; when it exits (or writes something that is not
JSON-RPC) every call waiting on it fails at once with :class:`UpstreamError`, and it
is started again after ``restart_ms``, doubling to ``restart_max_ms``. An HTTP server
is handshaken (its ``Mcp-Session-Id`` kept) and listed; a call finding its session
gone (404) handshakes again once.

:meth:`Upstream.request` is cancellable: cancelled (the client's deadline, its
``notifications/cancelled``, its disconnect), it tells the upstream
``notifications/cancelled`` for that request before it lets go.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx2
import msgspec
import trio

from ..adapters.h1 import H1Error, H1Pool, RequestHead, Timeouts
from . import jsonrpc
from .settings import McpServerConfig, expand_env

log = logging.getLogger("aiserve_trio.mcp")

#: The handshake version the gateway offers upstream (it accepts any it knows back).
UPSTREAM_VERSION = "2025-11-25"
HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
CLIENT_INFO = {"name": "aiserve-trio", "version": "0.1.0"}
#: A line (stdio) or a body (HTTP) an upstream may send at most.
MAX_UPSTREAM_MESSAGE = 16 * 1024 * 1024
#: Pages of a list fetched at most (a server that pages forever is cut there).
MAX_PAGES = 100
#: How long the handshake and the listing may take.
START_TIMEOUT_S = 20.0
#: How long a cancellation sent upstream may take.
CANCEL_TIMEOUT_S = 1.0
#: A message larger than this is decoded in a worker thread: 5 MB of small JSON items
#: take ~60 ms to decode, three times the 20 ms the loop may be held.
BIG_MESSAGE = 256 * 1024


async def decode(data: bytes | memoryview) -> Any:
    """``data`` decoded; a big one off the event loop (raises msgspec.DecodeError)."""
    if len(data) > BIG_MESSAGE:
        return await trio.to_thread.run_sync(jsonrpc.decode, data)
    return jsonrpc.decode(data)


Note = Callable[[dict[str, Any]], None]


class UpstreamError(Exception):
    """A call the upstream did not answer with a result: its JSON-RPC error (``code``
    from the upstream), or the gateway's (:data:`jsonrpc.UPSTREAM_FAILED`)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


class _Pending:
    __slots__ = ("done", "error", "note", "result", "size")

    def __init__(self, note: Note | None) -> None:
        self.done = trio.Event()
        self.result: Any = None
        #: The answer's size on the wire (bytes).
        self.size = 0
        self.error: UpstreamError | None = None
        self.note = note


class Upstream(ABC):
    """One upstream server: its state, its lists, and calls to it (a transport --
    :class:`StdioUpstream`, :class:`HttpUpstream` -- supplies the three abstract methods)."""

    def __init__(self, name: str, config: McpServerConfig) -> None:
        self.name = name
        self.config = config
        #: ``starting``, ``ready``, ``down`` (restarting) or ``stopped``.
        self.state = "starting"
        #: Why it is down (or its last failure).
        self.error = ""
        self.restarts = 0
        self.protocol = ""
        self.server_info: dict[str, Any] = {}
        self.capabilities: dict[str, Any] = {}
        self.tools: list[dict[str, Any]] = []
        self.prompts: list[dict[str, Any]] = []
        self.resources: list[dict[str, Any]] = []
        self.templates: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        #: Set (and replaced) whenever ``state`` changes: a caller waiting for a start.
        self._changed = trio.Event()
        self._relist = trio.Event()

    # --- what the hub and the endpoint read ------------------------------------------

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "state": self.state,
            "transport": self.config.transport,
            "tools": len(self.tools),
            "restarts": self.restarts,
        }
        if self.error:
            out["error"] = self.error
        return out

    def _set(self, state: str, error: str = "") -> None:
        self.state = state
        if error:
            self.error = error
        elif state == "ready":
            self.error = ""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_ready(self) -> None:
        """Return once the server is ready (the caller's scope bounds the wait)."""
        while self.state != "ready":
            await self._changed.wait()

    # --- requests ----------------------------------------------------------------------

    @abstractmethod
    async def request(
        self, method: str, params: dict[str, Any], note: Note | None = None,
        sized: list[int] | None = None,
    ) -> Any:  # fmt: skip
        """Send ``method`` and wait for its result (the caller's cancel scope bounds it).

        Args:
            note: called with each notification about this request (progress).
            sized: the answer's size on the wire is appended to it.

        Raises:
            UpstreamError: the upstream's error, or it is down, died or answered garbage.
        """

    @abstractmethod
    async def notify(self, method: str, params: dict[str, Any]) -> None:
        """Send notification ``method`` (no answer)."""

    async def _cancelled(self, rid: int, reason: str) -> None:
        """Tell the upstream a request is no longer wanted (shielded, bounded)."""
        gone = (UpstreamError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(CANCEL_TIMEOUT_S),
            contextlib.suppress(*gone),
        ):
            await self.notify("notifications/cancelled", {"requestId": rid, "reason": reason})

    # --- the handshake and the lists ----------------------------------------------------

    async def _handshake(self) -> None:
        init = await self.request(
            "initialize",
            {
                "protocolVersion": UPSTREAM_VERSION,
                "capabilities": {},
                "clientInfo": CLIENT_INFO,
            },
        )
        if not isinstance(init, dict):
            raise UpstreamError(jsonrpc.UPSTREAM_FAILED, "initialize answered no object")
        version = init.get("protocolVersion")
        if version not in HANDSHAKE_VERSIONS:
            raise UpstreamError(
                jsonrpc.UPSTREAM_FAILED, f"the server speaks protocol {str(version)[:40]!r}"
            )
        self.protocol = str(version)
        caps = init.get("capabilities")
        self.capabilities = caps if isinstance(caps, dict) else {}
        info = init.get("serverInfo")
        self.server_info = info if isinstance(info, dict) else {}
        self._on_session(init)
        await self.notify("notifications/initialized", {})

    def _on_session(self, init: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Hook: the handshake's result arrived (HTTP keeps its headers' session)."""

    async def _list_all(self, method: str, key: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(MAX_PAGES):
            params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
            page = await self.request(method, params)
            got = page.get(key) if isinstance(page, dict) else None
            if not isinstance(got, list):
                raise UpstreamError(jsonrpc.UPSTREAM_FAILED, f"{method} answered no {key} list")
            items += [i for i in got if isinstance(i, dict) and isinstance(i.get(_NAME[key]), str)]
            nxt = page.get("nextCursor")
            if not isinstance(nxt, str) or not nxt:
                break
            cursor = nxt
        return items

    async def _refresh(self) -> None:
        caps = self.capabilities
        if "tools" in caps:
            self.tools = await self._list_all("tools/list", "tools")
        if "prompts" in caps:
            self.prompts = await self._list_all("prompts/list", "prompts")
        if "resources" in caps:
            self.resources = await self._list_all("resources/list", "resources")
            self.templates = await self._list_all("resources/templates/list", "resourceTemplates")

    def _notification(self, msg: dict[str, Any], pending: dict[int, _Pending]) -> None:
        method = msg.get("method")
        params = msg.get("params")
        params = params if isinstance(params, dict) else {}
        if method == "notifications/progress":
            p = pending.get(params.get("progressToken"))  # type: ignore[arg-type]
            if p is not None and p.note is not None:
                p.note(msg)
        elif method in _LIST_CHANGED:
            self._relist.set()

    async def _relister(self) -> None:
        """Fetch the lists again whenever the server says one changed."""
        while True:
            await self._relist.wait()
            self._relist = trio.Event()
            try:
                with trio.fail_after(START_TIMEOUT_S):
                    await self._refresh()
            except (UpstreamError, trio.TooSlowError) as exc:
                log.warning("mcp %s: listing again failed: %s", self.name, exc)

    @abstractmethod
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect (or start the child), list, and keep the server up until cancelled."""


_NAME = {"tools": "name", "prompts": "name", "resources": "uri", "resourceTemplates": "uriTemplate"}
_LIST_CHANGED = frozenset(
    {
        "notifications/tools/list_changed",
        "notifications/prompts/list_changed",
        "notifications/resources/list_changed",
    }
)


def _answer(msg: dict[str, Any], pending: dict[int, _Pending], size: int = 0) -> None:
    """Resolve the pending request ``msg`` answers (an unknown id is dropped)."""
    p = pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
    if p is None:
        return
    p.size = size
    if "error" in msg:
        err = msg["error"]
        if isinstance(err, dict):
            code = err.get("code")
            p.error = UpstreamError(
                code if isinstance(code, int) else jsonrpc.INTERNAL_ERROR,
                str(err.get("message", ""))[:1000],
                err.get("data"),
            )
        else:
            p.error = UpstreamError(jsonrpc.UPSTREAM_FAILED, "the upstream answered a bad error")
    else:
        p.result = msg.get("result")
    p.done.set()


def _fail_all(pending: dict[int, _Pending], why: str) -> None:
    for p in pending.values():
        p.error = UpstreamError(jsonrpc.UPSTREAM_FAILED, why)
        p.done.set()
    pending.clear()


class StdioUpstream(Upstream):
    """A server the gateway runs as its child: JSON-RPC lines on its stdin and stdout."""

    def __init__(self, name: str, config: McpServerConfig) -> None:
        super().__init__(name, config)
        self._pending: dict[int, _Pending] = {}
        self._stdin: trio.abc.SendStream | None = None
        self._write = trio.StrictFIFOLock()
        #: The running child (killed to restart it after garbage).
        self._proc: trio.Process | None = None
        self.pid: int | None = None

    async def _send(self, msg: dict[str, Any]) -> None:
        stdin = self._stdin
        if stdin is None:
            raise UpstreamError(
                jsonrpc.UPSTREAM_FAILED, f"MCP server {self.name!r} is {self.state}"
            )
        line = jsonrpc.encode(msg) + b"\n"
        async with self._write:
            try:
                await stdin.send_all(line)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise UpstreamError(
                    jsonrpc.UPSTREAM_FAILED, f"MCP server {self.name!r} exited"
                ) from exc

    async def request(
        self, method: str, params: dict[str, Any], note: Note | None = None,
        sized: list[int] | None = None,
    ) -> Any:  # fmt: skip
        rid = next(self._ids)
        if note is not None:
            params = {**params, "_meta": {**params.get("_meta", {}), "progressToken": rid}}
        p = self._pending[rid] = _Pending(note)
        try:
            await self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
            await p.done.wait()
        except trio.Cancelled:
            if self._pending.pop(rid, None) is not None and method != "initialize":
                await self._cancelled(rid, "the gateway's caller gave up (deadline or cancel)")
            raise
        except BaseException:
            self._pending.pop(rid, None)
            raise
        if p.error is not None:
            raise p.error
        if sized is not None:
            sized.append(p.size)
        return p.result

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        await self._send({"jsonrpc": "2.0", "method": method, "params": params})

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the server, restarting it with backoff, until cancelled."""
        task_status.started()
        cfg = self.config
        delay = cfg.restart_ms / 1000
        while True:
            started = trio.current_time()
            why = await self._run_once()
            _fail_all(self._pending, f"MCP server {self.name!r} {why}")
            self._set("down", why)
            log.warning("mcp %s: %s; starting it again in %.1f s", self.name, why, delay)
            if trio.current_time() - started > 60:
                delay = cfg.restart_ms / 1000  # it ran a while: a fresh failure
            await trio.sleep(delay)
            delay = min(delay * 2, cfg.restart_max_ms / 1000)
            self.restarts += 1
            self._set("starting")

    async def _run_once(self) -> str:
        """Start the child, serve it until it exits; why it ended."""
        cfg = self.config
        try:
            env = {**os.environ, **{k: expand_env(v) for k, v in cfg.env.items()}}
        except KeyError as exc:
            return f"cannot start: {exc.args[0]}"
        try:
            proc = await trio.lowlevel.open_process(
                cfg.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
        except OSError as exc:
            return f"cannot start: {exc}"
        assert proc.stdin is not None
        assert proc.stdout is not None
        self._proc = proc
        self.pid = proc.pid
        why = "exited"
        try:
            async with trio.open_nursery() as nursery:
                self._stdin = proc.stdin
                ended: list[str] = []

                async def read() -> None:
                    why = await self._reader(proc.stdout)  # type: ignore[arg-type]
                    ended.append(why)
                    # Those waiting learn it now, not after the child is stopped.
                    _fail_all(self._pending, f"MCP server {self.name!r} {why}")
                    nursery.cancel_scope.cancel()

                nursery.start_soon(read)
                try:
                    with trio.fail_after(START_TIMEOUT_S):
                        await self._handshake()
                        await self._refresh()
                except (UpstreamError, trio.TooSlowError) as exc:
                    ended.append(f"failed its start: {exc or 'too slow'}")
                    nursery.cancel_scope.cancel()
                    return ended[0]
                self._set("ready")
                nursery.start_soon(self._relister)
                await proc.wait()
                ended.append(f"exited with status {proc.returncode}")
                nursery.cancel_scope.cancel()
            why = ended[0] if ended else why
        finally:
            self._stdin = None
            self._proc = None
            with trio.CancelScope(shield=True):
                await _stop(proc)
        return why

    async def _reader(self, stdout: trio.abc.ReceiveStream) -> str:
        """Read the child's lines until it closes stdout or writes garbage; why it ended."""
        buf = bytearray()
        pending = self._pending
        scanned = 0  # what of buf has no newline (a long line is not searched again)
        while True:
            chunk = await stdout.receive_some(65536)
            if not chunk:
                return "closed its output"
            buf += chunk
            while True:
                end = buf.find(b"\n", scanned)
                if end < 0:
                    scanned = len(buf)
                    if len(buf) > MAX_UPSTREAM_MESSAGE:
                        return "wrote a line over 16 MiB"
                    break
                scanned = 0
                try:
                    # Decoded where it lies: a big line's copies would take milliseconds.
                    with memoryview(buf) as view, view[:end] as line:
                        head = bytes(line[:80])
                        blank = not head.strip() and not bytes(line).strip()
                        msg = None if blank else await decode(line)
                except msgspec.DecodeError:
                    return f"answered garbage (not JSON-RPC): {head!r}"
                del buf[: end + 1]  # from the front: O(1) for a bytearray
                if msg is None:  # an empty line
                    continue
                if not isinstance(msg, dict):
                    return f"answered garbage (not JSON-RPC): {head!r}"
                await self._dispatch(msg, pending, end)
                del msg  # a big answer is its caller's to free (off the loop), not ours
            await trio.lowlevel.checkpoint()

    async def _dispatch(
        self, msg: dict[str, Any], pending: dict[int, _Pending], size: int = 0
    ) -> None:
        if "method" not in msg:
            _answer(msg, pending, size)
        elif "id" in msg:  # the server asks the gateway: only ping is answered
            rid = msg.get("id")
            if msg.get("method") == "ping":
                reply: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "result": {}}
            else:
                reply = jsonrpc.error(
                    jsonrpc.RpcError(jsonrpc.METHOD_NOT_FOUND, "the gateway answers no requests"),
                    rid,
                )
            with contextlib.suppress(UpstreamError):
                await self._send(reply)
        else:
            self._notification(msg, pending)

    def kill(self) -> None:
        """Kill the child (it is started again): the tests' crash, an operator's restart."""
        if self._proc is not None:
            self._proc.kill()


async def _stop(proc: trio.Process) -> None:
    """End a child: close its stdin, give it a moment, then kill it."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            await proc.stdin.aclose()
    with trio.move_on_after(0.5):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    if proc.stdout is not None:
        await proc.stdout.aclose()


class _Exchange:
    """One POST's answer: its status, headers (lower-case names) and body pieces."""

    __slots__ = ("chunks", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], chunks: AsyncIterator[bytes]) -> None:
        self.status = status
        self.headers = headers
        self.chunks = chunks


class _H1:
    """``http://`` upstreams: the gateway's lean HTTP/1.1 client (adapters/h1.py)."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        port = u.port or 80
        self._pool = H1Pool(u.hostname or "127.0.0.1", port, max_connections=64)
        host = u.hostname or ""
        host = f"[{host}]" if ":" in host else host
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self._head = RequestHead("POST", target, f"{host}:{port}", [])

    @contextlib.asynccontextmanager
    async def exchange(self, body: bytes, headers: dict[str, str]) -> AsyncIterator[_Exchange]:
        head = self._head.build([(k.encode(), v.encode()) for k, v in headers.items()], body)
        async with self._pool.request(head, body, Timeouts(io=3600.0, connect=10.0)) as resp:
            rh = {k.decode("latin-1"): v.decode("latin-1") for k, v in resp.headers}
            yield _Exchange(resp.status, rh, resp.__aiter__())

    async def aclose(self) -> None:
        await self._pool.aclose()


class _Httpx:
    """``https://`` upstreams: httpx2 (its TLS, certificates and HTTP/2)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._client = httpx2.AsyncClient(
            follow_redirects=False,
            trust_env=False,
            limits=httpx2.Limits(max_connections=64, max_keepalive_connections=16),
        )

    @contextlib.asynccontextmanager
    async def exchange(self, body: bytes, headers: dict[str, str]) -> AsyncIterator[_Exchange]:
        timeout = httpx2.Timeout(None, connect=10.0)
        req = self._client.build_request(
            "POST", self._url, content=body, headers=headers, timeout=timeout
        )
        resp = await self._client.send(req, stream=True)
        try:
            yield _Exchange(resp.status_code, dict(resp.headers), resp.aiter_bytes())
        finally:
            with trio.CancelScope(shield=True):
                await resp.aclose()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._client.aclose()


#: What a broken upstream connection raises, by client.
_HTTP_ERRORS = (H1Error, httpx2.HTTPError, OSError, trio.BrokenResourceError)


class HttpUpstream(Upstream):
    """A Streamable HTTP server: each request a POST, answered with JSON or an SSE stream."""

    def __init__(self, name: str, config: McpServerConfig) -> None:
        super().__init__(name, config)
        url = config.url
        self._http: _H1 | _Httpx = _H1(url) if url.startswith("http://") else _Httpx(url)
        self._session: str | None = None
        self._pending: dict[int, _Pending] = {}
        self._reinit = trio.Lock()

    def _headers(self) -> dict[str, str]:
        h = {k.lower(): expand_env(v) for k, v in self.config.headers.items()}
        h["content-type"] = "application/json"
        h["accept"] = "application/json, text/event-stream"
        if self.protocol:
            h["mcp-protocol-version"] = self.protocol
        if self._session is not None:
            h["mcp-session-id"] = self._session
        return h

    async def _post(
        self, msg: dict[str, Any], rid: int | None, note: Note | None
    ) -> tuple[int, Any, int]:
        """POST ``msg``; (status, the message answering ``rid`` -- None for a notification --,
        its size)."""
        try:
            headers = self._headers()
        except KeyError as exc:
            raise UpstreamError(jsonrpc.UPSTREAM_FAILED, f"cannot call: {exc.args[0]}") from exc
        body = jsonrpc.encode(msg)
        try:
            async with self._http.exchange(body, headers) as resp:
                return await self._answer(resp, msg, rid, note)
        except _HTTP_ERRORS as exc:
            raise UpstreamError(
                jsonrpc.UPSTREAM_FAILED, f"MCP server {self.name!r} cannot be reached: {exc}"
            ) from exc

    async def _answer(
        self, resp: _Exchange, msg: dict[str, Any], rid: int | None, note: Note | None
    ) -> tuple[int, Any, int]:
        status = resp.status
        if rid is None and status < 400:
            return status, None, 0
        if status == 404 and self._session is not None:
            return 404, None, 0
        if status >= 400:
            why = f"MCP server {self.name!r} answered HTTP {status}"
            raise UpstreamError(jsonrpc.UPSTREAM_FAILED, why)
        if msg.get("method") == "initialize":
            self._session = resp.headers.get("mcp-session-id") or None
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            answer, size = await self._sse(resp.chunks, rid, note)
            return status, answer, size
        data = await _read_capped(resp.chunks)
        try:
            answer = await decode(data)
        except msgspec.DecodeError:
            raise UpstreamError(
                jsonrpc.UPSTREAM_FAILED,
                f"MCP server {self.name!r} answered garbage (not JSON-RPC): {data[:80]!r}",
            ) from None
        if isinstance(answer, list):  # a batch of one
            answer = next((a for a in answer if isinstance(a, dict) and a.get("id") == rid), None)
        if not isinstance(answer, dict) or answer.get("id") != rid:
            why = f"MCP server {self.name!r} answered another request"
            raise UpstreamError(jsonrpc.UPSTREAM_FAILED, why)
        return status, answer, len(data)

    async def _sse(
        self, chunks: AsyncIterator[bytes], rid: int | None, note: Note | None
    ) -> tuple[Any, int]:
        """Read SSE events until the one answering ``rid``; it, and its size."""
        buf = bytearray()
        scanned = 0  # what of buf holds no event's end (a long event is not searched again)
        async for chunk in chunks:
            buf += chunk.replace(b"\r\n", b"\n")
            if len(buf) > MAX_UPSTREAM_MESSAGE:
                raise UpstreamError(jsonrpc.UPSTREAM_FAILED, "an answer over 16 MiB")
            while (end := buf.find(b"\n\n", scanned)) >= 0:
                event = bytes(buf[:end])
                del buf[: end + 2]
                scanned = 0
                data = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
                text = b"\n".join(data)
                if not text.strip():
                    continue  # a priming event (an id for resumption, no message)
                try:
                    msg = await decode(text)
                except msgspec.DecodeError:
                    raise UpstreamError(
                        jsonrpc.UPSTREAM_FAILED,
                        f"MCP server {self.name!r} answered garbage (not JSON-RPC): {text[:80]!r}",
                    ) from None
                if not isinstance(msg, dict):
                    continue
                if "method" in msg and "id" not in msg:
                    params = msg.get("params")
                    if (
                        note is not None
                        and msg.get("method") == "notifications/progress"
                        and isinstance(params, dict)
                        and params.get("progressToken") == rid
                    ):
                        note(msg)
                    elif msg.get("method") in _LIST_CHANGED:
                        self._relist.set()
                elif "method" not in msg and msg.get("id") == rid:
                    return msg, len(text)
            scanned = max(0, len(buf) - 1)
        raise UpstreamError(
            jsonrpc.UPSTREAM_FAILED, f"MCP server {self.name!r} ended its stream without an answer"
        )

    async def request(
        self, method: str, params: dict[str, Any], note: Note | None = None,
        sized: list[int] | None = None,
    ) -> Any:  # fmt: skip
        for attempt in range(2):
            rid = next(self._ids)
            if note is not None:
                params = {**params, "_meta": {**params.get("_meta", {}), "progressToken": rid}}
            msg = {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}
            try:
                status, answer, size = await self._post(msg, rid, note)
            except trio.Cancelled:
                await self._cancelled(rid, "the gateway's caller gave up (deadline or cancel)")
                raise
            if status == 404 and attempt == 0 and method != "initialize":
                await self._again()  # the server forgot the session: handshake again
                continue
            if answer is None:
                break
            p = _Pending(None)
            self._pending[rid] = p
            _answer(answer, self._pending)
            if p.error is not None:
                raise p.error
            if sized is not None:
                sized.append(size)
            return p.result
        raise UpstreamError(jsonrpc.UPSTREAM_FAILED, f"MCP server {self.name!r} lost the session")

    async def _again(self) -> None:
        session = self._session
        async with self._reinit:
            if self._session == session:
                self._session = None
                await self._handshake()

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        await self._post({"jsonrpc": "2.0", "method": method, "params": params}, None, None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Handshake and list (again after a failure, with backoff), then follow changes."""
        task_status.started()
        cfg = self.config
        delay = cfg.restart_ms / 1000
        try:
            while True:
                try:
                    with trio.fail_after(START_TIMEOUT_S):
                        self._session = None
                        self.protocol = ""
                        await self._handshake()
                        await self._refresh()
                except (UpstreamError, trio.TooSlowError) as exc:
                    why = f"failed its start: {exc or 'too slow'}"
                    self._set("down", why)
                    log.warning("mcp %s: %s; trying again in %.1f s", self.name, why, delay)
                    await trio.sleep(delay)
                    delay = min(delay * 2, cfg.restart_max_ms / 1000)
                    self.restarts += 1
                    continue
                self._set("ready")
                await self._relister()
        finally:
            await self._http.aclose()


async def _read_capped(chunks: AsyncIterator[bytes]) -> bytes:
    out = bytearray()
    async for chunk in chunks:
        out += chunk
        if len(out) > MAX_UPSTREAM_MESSAGE:
            raise UpstreamError(jsonrpc.UPSTREAM_FAILED, "an answer over 16 MiB")
    return bytes(out)


def build_upstream(name: str, config: McpServerConfig) -> Upstream:
    if config.command:
        return StdioUpstream(name, config)
    return HttpUpstream(name, config)


__all__ = ["Upstream", "UpstreamError", "build_upstream"]
