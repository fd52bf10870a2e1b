"""The context stage: session history and variables, input policies, the prompt.

Turns the :class:`~.types.ParsedRequest` into a :class:`~.types.Prepared`:
the adapter's :class:`~aiserve_trio.adapters.base.InferenceRequest` (session
context in, input policies applied, fitted to the model's window by the
adapter) and what the sse stage needs to answer (output filters, the policy
context, whether the request was degraded). The session load is the part that
can be slow or fail (the bus may be Redis); if the stage's cut point passes or
the bus is unreachable, the route's ``on_context_timeout`` decides: ``fail``
(504 naming the stage, or 503 ``session_bus_unavailable``) or ``degrade`` (go
on without session context; the response says so in ``X-Aiserve-Degraded``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..adapters.base import InferenceRequest, Message
from ..apis.common import NativeSpec, Stored
from ..cache.service import Cache, Ticket
from ..core.errors import BadRequest, NotFound, StageDeadlineExceeded
from ..core.slices import run_sliced
from ..policies.base import OutputFilter, Policy, PolicyContext, redact_values
from ..sessions.bus import Session, SessionBusError, Turn, check_vars, is_response_id
from .channel import Inbox, Outbox
from .handoff import hand_on
from .report import ContextReport
from .types import ParsedRequest, Prepared, RequestInfo

if TYPE_CHECKING:
    from ..sessions.bus import SessionBus

_FORWARDED = ("traceparent", "tracestate")
#: The session variable that links a stored response to the one it continued (a name
#: no client can set: theirs match ``[A-Za-z_][A-Za-z0-9_]*``).
PREVIOUS = "aiserve.previous_response_id"


def prompt_messages(req: ParsedRequest) -> list[Message]:
    """The request's own messages (each still with the JSON the client sent)."""
    return list(req.messages)


def new_turns(messages: list[Message]) -> list[Message]:
    """What this request adds to the conversation: the messages after the last
    assistant message (a user question, or tool results answering its calls)."""
    n = len(messages)
    while n and messages[n - 1].role != "assistant":
        n -= 1
    return messages[n:]


def with_session(
    messages: list[Message], session: Session, system_template: str
) -> tuple[list[Message], dict[str, str]]:
    """Put a session's variables (as a system prompt) and history before the request's messages."""
    prefix: list[Message] = []
    if session.variables:
        lines = "\n".join(f"{k}: {v}" for k, v in sorted(session.variables.items()))
        prefix.append(Message(role="system", content=system_template.replace("{vars}", lines)))
    prefix.extend(
        Message(
            role=t.role,
            content=t.content if t.content or not t.tool_calls else None,
            tool_calls=t.tool_calls,
            tool_call_id=t.tool_call_id,
        )
        for t in session.turns
    )
    # Leading system messages of the request stay first.
    n_sys = 0
    while n_sys < len(messages) and messages[n_sys].role in ("system", "developer"):
        n_sys += 1
    return [*messages[:n_sys], *prefix, *messages[n_sys:]], dict(session.variables)


async def _native_body(
    body: bytes,
    spec: NativeSpec,
    history: list[Message],
    policies: list[Policy],
    ctx: PolicyContext,
) -> bytes:
    """A native route's body: the session's earlier turns before the client's own, the
    text of its messages through the policies that take something out of text (the
    same bytes when they took nothing)."""
    turns = [{"role": m.role, "content": m.text()} for m in history]
    if turns:
        body = spec.history(body, turns)
    rewrite = _redactor(policies, ctx)
    if rewrite is not None:
        body = await run_sliced(spec.rewrite(body, rewrite))
    return body


def _redactor(policies: list[Policy], ctx: PolicyContext) -> Callable[[str], str] | None:
    """A text through the policies that take something out of text; None: none does."""
    redacting = [p for p in policies if type(p).redact_text is not Policy.redact_text]
    if not redacting:
        return None

    def rewrite(text: str) -> str:
        for p in redacting:
            text = p.redact_text(text, ctx)
        return text

    return rewrite


def _side_filters(policies: list[Policy], ctx: PolicyContext) -> list[OutputFilter]:
    return [f for p in policies if not p.content_only and (f := p.output_filter(ctx)) is not None]


def _token_limit(asked: int | None, cap: int | None) -> int | None:
    """The route's cap when the client asks for more or for nothing (then it goes upstream)."""
    if cap is None:
        return asked
    return cap if asked is None else min(asked, cap)


def _not_found(response_id: str) -> NotFound:
    return NotFound(
        f"Previous response with id {response_id!r} not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _tool_choice(req: ParsedRequest) -> str | None:
    choice = req.body.tool_choice
    return choice if isinstance(choice, str) or choice is None else choice.function.name


class ContextStage:
    """Loads the session, runs the input policies, and prepares the model's request."""

    name = "context"

    def __init__(
        self,
        info: RequestInfo,
        inbox: Inbox[ParsedRequest],
        to_inference: Outbox[Prepared],
        to_sse: Outbox[Prepared],
        bus: SessionBus | None,
        system_template: str,
        history_turns: int,
        clear_vars: frozenset[str] = frozenset(),
        cache: Cache | None = None,
    ) -> None:
        self.info = info
        self.cache = cache
        #: What the request does with the response cache (released when it ends).
        self.ticket: Ticket | None = None
        self.clear_vars = clear_vars
        #: The request's ``metadata`` as stored (redacted where the route redacts).
        self.metadata: dict[str, str] | None = None
        self.to_inference = to_inference
        self.to_sse = to_sse
        self.bus = bus
        self.system_template = system_template
        self.history_turns = history_turns
        self.owned = (to_inference, to_sse, inbox)
        #: The policies' notes and actions (set before they run, so a block is counted).
        self.policy: PolicyContext | None = None
        #: What the stage handed on, once it has.
        self.result: Prepared | None = None

    async def run(self, req: ParsedRequest) -> None:
        """Raises:
        SessionBusError: the bus failed and the route does not degrade.
        BadRequest: ``metadata`` is not acceptable as session variables.
        PolicyViolation: an input policy blocked the request.
        """
        info = self.info
        route = info.route
        self.policy = PolicyContext(
            route=route.label,
            channel=info.channel,
            tenant=info.tenant,
            request_id=info.request_id,
        )
        metadata = req.body.metadata
        if metadata:
            check_vars(metadata, "metadata")
            # Stored data is protected data: what the route's policies take out
            # of messages they take out of variables too (unless allowlisted).
            metadata = await run_sliced(
                redact_values(metadata, route.policies, self.policy, self.clear_vars)
            )
        self.metadata = metadata
        bus, sid = self.bus, info.session_id
        if req.native is not None and sid == info.request_id:
            # A native Responses request: the provider keeps its stored responses
            # (previous_response_id, store), the gateway no conversation of its own.
            sid = None
        if bus is None or sid is None:
            await self._hand_on(req, prompt_messages(req), {}, None)
            return
        ttl = info.route.config.context_ttl
        # An API that stores its replies under their ids (Responses) says what the
        # request asks of that.
        stored = route.codec.stored(req.api) if route.codec.stored is not None else None
        if stored is not None and sid == info.request_id:
            await self._response(req, stored, bus, ttl)
            return
        if stored is not None and stored.previous is not None and req.native is None:
            raise BadRequest(
                "`previous_response_id` continues a stored response; it cannot go with "
                "X-Session-Id, which names another conversation",
                param="previous_response_id",
            )
        try:
            if metadata:
                await bus.set_vars(info.tenant, sid, metadata, ttl)
            session = await bus.load(info.tenant, sid, self.history_turns, ttl)
        except SessionBusError:
            if info.route.config.on_context_timeout != "degrade":
                raise
            await self._hand_on(req, prompt_messages(req), {}, "context")
            return
        messages, variables = with_session(prompt_messages(req), session, self.system_template)
        await self._hand_on(req, messages, variables, None)

    async def _response(
        self, req: ParsedRequest, stored: Stored, bus: SessionBus, ttl: int
    ) -> None:
        """A Responses request, stored under its response id: it continues the
        conversation of ``previous_response_id``, if it names one.

        Raises:
            BadRequest: ``previous_response_id`` is not an id (the error names it).
            NotFound: no stored response of this tenant has that id (expired, or never;
                or not a response's id at all).
            SessionBusError: the bus failed (a continuation never goes on without its past).
        """
        info = self.info
        store = stored.store
        turns: list[Turn] = []
        previous = stored.previous
        if previous is not None:
            # Only a response's own id: another session (a chat's, under a client's
            # id) is not a conversation this request may read as its past.
            if not is_response_id(previous):
                raise _not_found(previous)
            turns = await self._conversation(bus, previous, ttl)
            if store:
                await bus.set_vars(info.tenant, info.request_id, {PREVIOUS: previous}, ttl)
        if store and self.metadata:
            await bus.set_vars(info.tenant, info.request_id, self.metadata, ttl)
        session = Session(turns=turns)
        messages, _ = with_session(prompt_messages(req), session, self.system_template)
        await self._hand_on(req, messages, {}, None, store=store)

    async def _conversation(self, bus: SessionBus, response_id: str, ttl: int) -> list[Turn]:
        """The turns of a stored response and of those it continued, oldest first,
        at most ``history_turns`` of them."""
        tenant, limit = self.info.tenant, max(self.history_turns, 1)
        parts: list[list[Turn]] = []
        rid: str | None = response_id
        held = 0
        while rid is not None and held < limit:
            session = await bus.load(tenant, rid, limit, ttl)
            if not parts and not session.turns:
                raise _not_found(response_id)
            parts.append(session.turns)
            held += len(session.turns)
            rid = session.variables.get(PREVIOUS)
        turns = [t for part in reversed(parts) for t in part]
        return turns[-limit:]

    async def expired(self, req: ParsedRequest) -> None:
        """The cut passed while the session was loading: degrade or fail."""
        if self.info.route.config.on_context_timeout != "degrade":
            raise StageDeadlineExceeded("context")
        # Still bounded: whatever is left must leave the model its own budget.
        with trio.move_on_at(self.info.budget.inference_end):
            await self._hand_on(req, prompt_messages(req), {}, "context")
            return
        raise StageDeadlineExceeded("context")

    def report(self) -> ContextReport:
        """What the stage prepared and decided (its shell asks when it ends)."""
        return ContextReport(self.result, self.policy, self.ticket)

    async def _hand_on(
        self,
        req: ParsedRequest,
        messages: list[Message],
        variables: dict[str, str],
        degraded: str | None,
        *,
        store: bool = True,
    ) -> None:
        info = self.info
        route = info.route
        if self.metadata:
            variables = {**variables, **self.metadata}
        ctx = self.policy
        assert ctx is not None  # run() made it
        own = len(req.messages)
        # The messages as the policies left them (the adapter may fit a copy to the model).
        messages, request = await self._upstream(req, messages, variables, ctx)
        # A native reply is the provider's own events: not the cache's to replay.
        if self.cache is not None and request.native is None:
            # Keyed on the request as it goes upstream: after session context,
            # input policies (they ran, hit or not) and fitting to the window.
            self.ticket = await self.cache.admit(
                path=route.config.path,
                tenant=info.tenant,
                channel=info.channel,
                cache_control=info.headers.get("cache-control"),
                temperature=req.body.temperature,
                request=request,
                deadline=info.budget.cut("context"),
                request_id=info.request_id,
            )
        view: object = None
        rewrite = _redactor(route.policies, ctx)
        echo = route.codec.echo
        if echo is not None and rewrite is not None:
            # The reply echoes the request: what was sent upstream, not what the client
            # wrote (issue 51, item 2), on a route that promises PII never comes back.
            view = await run_sliced(echo(req.api, rewrite, self.metadata))
        prepared = Prepared(
            parsed=req,
            inference=request,
            filters=[f for p in route.policies if (f := p.output_filter(ctx)) is not None],
            side_filters=partial(_side_filters, route.policies, ctx),
            policy=ctx,
            degraded=degraded,
            # A Responses request's whole input is new: it is stored under its id.
            new_turns=(
                new_turns(messages[-own:])
                if route.codec.stored is None
                else [m for m in messages[-own:] if m.role not in ("system", "developer")]
            ),
            cache=self.ticket,
            store=store,
            view=view,
        )
        self.result = prepared
        # The sse stage's copy first: it must be there when the first delta is.
        self.to_sse.send_nowait(prepared)
        await hand_on(self.to_inference, prepared)

    async def _upstream(
        self,
        req: ParsedRequest,
        messages: list[Message],
        variables: dict[str, str],
        ctx: PolicyContext,
    ) -> tuple[list[Message], InferenceRequest]:
        """The messages through the route's input policies, and the request as it goes
        upstream: with the headers forwarded, the native body when the client speaks the
        provider's API, else fitted to the model by the route's adapter."""
        info = self.info
        route = info.route
        own = len(req.messages)
        extra = req.extra
        for policy in route.policies:
            # Sliced: a megabyte of text must not hold the event loop (and the
            # stage's cut point applies at each checkpoint).
            messages = await run_sliced(policy.input_steps(messages, ctx))
            extra = await run_sliced(policy.fields_steps(extra, ctx))
        forward = {k: info.headers[k] for k in _FORWARDED if k in info.headers}
        native: bytes | None = None
        spec = route.codec.native
        if req.native is not None and spec is not None:
            native = await _native_body(
                req.native, spec, messages[: len(messages) - own], route.policies, ctx
            )
            forward.update((k, info.headers[k]) for k in spec.headers if k in info.headers)
        request = InferenceRequest(
            request_id=info.request_id,
            model=req.model,
            messages=messages,
            deadline=info.budget.inference_end,
            max_tokens=_token_limit(req.max_tokens, route.config.max_tokens),
            temperature=req.body.temperature,
            top_p=req.body.top_p,
            stop=req.stop,
            variables=variables,
            forward_headers=forward,
            tool_names=[t.function.name for t in req.body.tools or () if t.function is not None],
            tool_choice=_tool_choice(req),
            extra=extra,
            native=native,
            native_api=route.config.kind if native is not None else "",
        )
        if native is None:
            request = await route.adapter.prepare(request)
        return messages, request
