"""A finished request as one ``audit_requests`` row (pure: no I/O).

Names, counts and times only: no message content unless ``[audit] content =
"redacted"``, and then the prompt as the model saw it (after the route's input
policies) and the reply as the client got it (after its output filters). The
session id is kept as a keyed hash, so that one session's requests can be
found without the id being readable.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from .schema import COLUMNS

if TYPE_CHECKING:
    from ..stages.outcome import Outcome

Row = tuple[Any, ...]


#: ``[audit] max_content_chars``'s default.
MAX_CONTENT_CHARS = 8192


class RowBuilder:
    """Makes rows; ``content``: keep the redacted prompt and reply, each cut to
    ``max_chars`` characters."""

    def __init__(
        self, session_key: bytes, *, content: bool = False, max_chars: int = MAX_CONTENT_CHARS
    ) -> None:
        self._key = session_key
        self.content = content
        self.max_chars = max_chars

    def session_hash(self, session_id: str | None) -> str | None:
        if session_id is None:
            return None
        return hmac.new(self._key, session_id.encode(), hashlib.sha256).hexdigest()[:32]

    def row(self, outcome: Outcome, ts: float) -> Row:
        """The row of ``outcome``, which arrived at Unix time ``ts``.

        Called on the request path, once per request: every branch below skips work
        for what a request does not have (no session, no policy action, no chain).
        """
        o = outcome
        info = o.info
        if info is None:
            trace_id = session = None
            api = "chat"
        else:
            trace_id = info.trace.trace_id
            session = info.session_id
            if session is not None:
                session = self.session_hash(session)
            api = info.route.config.kind
        usage = o.usage
        served = o.served
        error = o.error
        arrival = o.arrival
        ttft = o.first_token_at
        policy = o.policy
        chain = o.chain
        prompt = reply = prompt_chars = reply_chars = None
        if self.content:
            prompt, reply = _content(o)
            # A length check each; a slice only past the cap (the cut text's length kept).
            cap = self.max_chars
            if prompt is not None and len(prompt) > cap:
                prompt_chars = len(prompt)
                prompt = prompt[:cap]
            if reply is not None and len(reply) > cap:
                reply_chars = len(reply)
                reply = reply[:cap]
        return (
            o.request_id,
            trace_id,
            ts,
            o.tenant,
            o.key_id,
            o.route,
            api,
            o.channel,
            session,
            o.model,
            o.served_model or o.model,
            None if served is None else served.deployment,
            None if served is None else served.fallback,
            o.status,
            None if error is None else error.code,
            0 if usage is None else usage.prompt_tokens,
            0 if usage is None else usage.completion_tokens,
            o.cost,
            o.saved,
            None if ttft is None else _ms(ttft - arrival),
            _ms(o.ended - arrival),
            o.cache,
            None if chain is None else ",".join(chain.names),
            _actions(policy.actions) if policy is not None and policy.actions else None,
            prompt,
            reply,
            prompt_chars,
            reply_chars,
            1,  # requests: one (wrong-key windows are counted in log.py)
            None,  # client: only on those windows' rows
        )


def _ms(seconds: float) -> float:
    """``seconds`` in milliseconds to the microsecond (``round`` is several times slower)."""
    return int(seconds * 1_000_000 + 0.5) / 1000


def _actions(actions: Sequence[tuple[str, str]]) -> str:
    return ",".join(f"{policy}:{action}" for policy, action in actions)


def _content(o: Outcome) -> tuple[str | None, str | None]:
    prepared = o.prepared
    prompt = None
    if prepared is not None:
        # The request's own turns as the model saw them: after the input policies.
        prompt = "\n".join(m.text() for m in prepared.new_turns) or None
    return prompt, (o.delivered or None)


_line = msgspec.json.Encoder()


def access_line(row: Row, columns: Sequence[str] = COLUMNS) -> bytes:
    """``row`` as one JSON line (the structured access log)."""
    return _line.encode(dict(zip(columns, row, strict=True))) + b"\n"
