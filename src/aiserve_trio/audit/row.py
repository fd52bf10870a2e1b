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


class RowBuilder:
    """Makes rows; ``content``: keep the redacted prompt and reply."""

    def __init__(self, session_key: bytes, *, content: bool = False) -> None:
        self._key = session_key
        self.content = content

    def session_hash(self, session_id: str | None) -> str | None:
        if session_id is None:
            return None
        return hmac.new(self._key, session_id.encode(), hashlib.sha256).hexdigest()[:32]

    def row(self, outcome: Outcome, ts: float) -> Row:
        """The row of ``outcome``, which arrived at Unix time ``ts``."""
        o = outcome
        info = o.info
        usage = o.usage
        served = o.served
        ttft = o.first_token_at
        actions = o.policy.actions if o.policy is not None else ()
        prompt = reply = None
        if self.content:
            prompt, reply = _content(o)
        return (
            o.request_id,
            info.trace.trace_id if info is not None else None,
            ts,
            o.tenant,
            o.key_id,
            o.route,
            api_of(o),
            o.channel,
            self.session_hash(info.session_id) if info is not None else None,
            o.model,
            o.served_model or o.model,
            served.deployment if served is not None else None,
            served.fallback if served is not None else None,
            o.status,
            o.error.code if o.error is not None else None,
            usage.prompt_tokens if usage is not None else 0,
            usage.completion_tokens if usage is not None else 0,
            o.cost,
            o.saved,
            None if ttft is None else round((ttft - o.arrival) * 1000, 3),
            round((o.ended - o.arrival) * 1000, 3),
            o.cache,
            ",".join(o.chain.names) if o.chain is not None else None,
            ",".join(f"{p}:{a}" for p, a in actions) or None,
            prompt,
            reply,
        )


def api_of(outcome: Outcome) -> str:
    """Which client API the request spoke (``chat``, ``embeddings``...)."""
    info = outcome.info
    if info is not None:
        return info.route.config.kind
    return "chat"


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
