"""The context stage: session history and variables, input policies, the prompt.

Turns the decoded :class:`~.parse.ChatRequest` into the adapter's
:class:`~aiserve_trio.adapters.base.InferenceRequest`, which the adapter then
prepares (fits to its context window). The session load is the part that can
be slow or fail (the bus may be Redis); if the stage's cut point passes or the
bus is unreachable, the route's ``on_context_timeout`` decides:
``fail`` (504 naming the stage, or 503 ``session_bus_unavailable``) or
``degrade`` (go on without session context; the response says so in the
``X-Aiserve-Degraded`` header).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ..adapters.base import InferenceRequest, Message
from ..errors import StageDeadlineExceeded
from ..policies.base import PolicyContext
from ..sessions.bus import SessionBusError, check_vars
from .parse import ChatRequest
from .request import RequestState

if TYPE_CHECKING:
    from ..sessions.bus import Session, SessionBus
    from ..sessions.outbox import TurnRecord

_FORWARDED = ("traceparent", "tracestate")


def prompt_messages(req: ChatRequest) -> list[Message]:
    """The request's messages as text-only prompt messages."""
    return [Message(role=m.role, content=m.text(), name=m.name) for m in req.body.messages]


def with_session(
    messages: list[Message], session: Session, system_template: str
) -> tuple[list[Message], dict[str, str]]:
    """Put a session's variables (as a system prompt) and history before the request's messages."""
    prefix: list[Message] = []
    if session.variables:
        lines = "\n".join(f"{k}: {v}" for k, v in sorted(session.variables.items()))
        prefix.append(Message(role="system", content=system_template.replace("{vars}", lines)))
    prefix.extend(Message(role=t.role, content=t.content) for t in session.turns)
    # Leading system messages of the request stay first.
    n_sys = 0
    while n_sys < len(messages) and messages[n_sys].role in ("system", "developer"):
        n_sys += 1
    return [*messages[:n_sys], *prefix, *messages[n_sys:]], dict(session.variables)


async def context_stage(
    state: RequestState,
    inbox: trio.MemoryReceiveChannel[ChatRequest],
    out: trio.MemorySendChannel[InferenceRequest],
    bus: SessionBus | None,
    system_template: str,
    history_turns: int,
    record: TurnRecord | None = None,
) -> None:
    """Run the context stage for one request (see the module docstring).

    Args:
        record: filled with the user's message as the model sees it, for the
            write-back after the reply.

    Raises:
        StageDeadlineExceeded: the cut point passed and the route does not degrade.
        SessionBusError: the bus failed and the route does not degrade.
        BadRequest: ``metadata`` is not acceptable as session variables, or
            the adapter cannot fit the prompt (``context_length_exceeded``).
    """
    route = state.route
    async with out, inbox:
        req: ChatRequest | None = None
        messages: list[Message] = []
        variables: dict[str, str] = {}
        bus_error: SessionBusError | None = None
        with trio.move_on_at(state.budget.context_end) as scope:
            try:
                req = await inbox.receive()
            except trio.EndOfChannel:
                return  # parse failed and says why
            state.mark("context")
            messages = prompt_messages(req)
            if req.body.metadata:
                check_vars(req.body.metadata, "metadata")
            try:
                if req.body.metadata and bus is not None and state.session_id:
                    await bus.set_vars(
                        state.tenant, state.session_id, req.body.metadata, route.config.context_ttl
                    )
                if bus is not None and state.session_id:
                    session = await bus.load(
                        state.tenant, state.session_id, history_turns, route.config.context_ttl
                    )
                    messages, variables = with_session(messages, session, system_template)
            except SessionBusError as exc:
                bus_error = exc
        if scope.cancelled_caught or bus_error is not None:
            if req is None:
                return  # still parsing: the parse stage reports its own expiry
            if route.config.on_context_timeout != "degrade":
                raise bus_error or StageDeadlineExceeded("context")
            state.degraded = "context"
            messages = prompt_messages(req)
            variables = {}
        assert req is not None
        if req.body.metadata:
            variables = {**variables, **req.body.metadata}
        ctx = PolicyContext(
            route=route.label,
            channel=state.channel,
            tenant=state.tenant,
            request_id=state.request_id,
        )
        # Set before the policies run, so that a block's recorded action is counted.
        state.policy_context = ctx
        for policy in route.policies:
            messages = policy.check_input(messages, ctx)
        if record is not None:
            own = messages[-len(req.body.messages) :] if req.body.messages else []
            record.user_text = next((m.content for m in reversed(own) if m.role == "user"), "")
        state.filters = [f for p in route.policies if (f := p.output_filter(ctx)) is not None]
        forward = {k: state.headers[k] for k in _FORWARDED if k in state.headers}
        request = InferenceRequest(
            request_id=state.request_id,
            model=req.model,
            messages=messages,
            deadline=state.budget.inference_end,
            max_tokens=req.max_tokens,
            temperature=req.body.temperature,
            top_p=req.body.top_p,
            stop=req.stop,
            variables=variables,
            forward_headers=forward,
        )
        # The backend's own fitting (its context window) comes after the input
        # policies, so it trims what the model will actually see.
        await out.send(await route.adapter.prepare(request))
