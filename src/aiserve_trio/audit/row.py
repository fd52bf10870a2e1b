"""A finished request as one ``audit_requests`` row (pure: no I/O).

Names, counts and times only: no message content unless ``[audit] content =
"redacted"``, and then the prompt as the model saw it (after the route's input
policies) and the reply as the client got it (after its output filters). A side
(prompt or reply) that the route's own ``gdpr-redact`` did not redact is put
through the default ``gdpr-redact`` detectors before it is stored (issue 51,
item 5: such a route's rows held full card numbers and e-mails): not here, on
the request path, but in the writer's thread (:meth:`RowBuilder.redact`), on the
text already cut near the cap. The session id is kept as a keyed hash, so that
one session's requests can be found without the id being readable.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..policies.redact import redacted_sides
from .schema import COLUMNS

if TYPE_CHECKING:
    from ..policies.stream import Rewriter
    from ..stages.outcome import Outcome
    from ..stages.types import Route

Row = tuple[Any, ...]


#: ``[audit] max_content_chars``'s default.
MAX_CONTENT_CHARS = 8192
_PROMPT, _REPLY, _PROMPT_CHARS, _REPLY_CHARS = (
    COLUMNS.index(c) for c in ("prompt", "reply", "prompt_chars", "reply_chars")
)


class Unredacted:
    """A prompt or reply cell still to go through the default detectors (its route does
    not redact that side): :meth:`RowBuilder.redact` makes it text in the writer's
    thread. Not a ``str`` on purpose: a row that reached the database or the access log
    with one would fail there, never store the text as it came."""

    __slots__ = ("cut", "text")

    def __init__(self, text: str, cut: bool) -> None:
        self.text = text
        #: ``text`` is the start of a longer text: its end may be half a number.
        self.cut = cut


class RowBuilder:
    """Makes rows; ``content``: keep the redacted prompt and reply, each cut to
    ``max_chars`` characters. ``redactor``: the default ``gdpr-redact`` detectors, for
    the sides a route does not redact itself (None: stored as the route left them)."""

    def __init__(
        self,
        session_key: bytes,
        *,
        content: bool = False,
        max_chars: int = MAX_CONTENT_CHARS,
        redactor: Rewriter | None = None,
    ) -> None:
        self._key = session_key
        self.content = content
        self.max_chars = max_chars
        self.redactor = redactor
        #: An unredacted text is kept this far past the cap: the detectors see a number
        #: or an address that crosses the cap whole, and what they take out is made up
        #: from the rest before the cut.
        self._keep = max_chars + (redactor.max_holdback if redactor is not None else 0)

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
            prompt, reply, prompt_chars, reply_chars = self._texts(o)
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
            0 if usage is None else usage.cache_read_tokens,
            0 if usage is None else usage.cache_write_tokens,
            o.cache_cost,
            o.usage_source,
        )

    def _texts(
        self, o: Outcome
    ) -> tuple[str | Unredacted | None, str | Unredacted | None, int | None, int | None]:
        """The prompt and the reply as the row keeps them, each cut to the cap, with its
        whole length when it was cut; a side the route does not redact wrapped for the
        writer's thread (:class:`Unredacted`), which redacts and cuts it."""
        info = o.info
        prompt: str | Unredacted | None
        reply: str | Unredacted | None
        prompt_chars = reply_chars = None
        prompt, reply = _content(o)
        # A length check each; a slice only past the cap (the cut text's length kept).
        cap = self.max_chars
        if self.redactor is not None and (prompt is not None or reply is not None):
            # A side the route does not redact: its text (kept a little past the
            # cap) is wrapped for the writer's thread, which redacts and cuts it.
            own_in, own_out = _redacts(None if info is None else info.route)
            keep = self._keep
            if prompt is not None and not own_in:
                if len(prompt) > cap:
                    prompt_chars = len(prompt)
                prompt = Unredacted(prompt[:keep], len(prompt) > keep)
            if reply is not None and not own_out:
                if len(reply) > cap:
                    reply_chars = len(reply)
                reply = Unredacted(reply[:keep], len(reply) > keep)
        if type(prompt) is str and len(prompt) > cap:
            prompt_chars = len(prompt)
            prompt = prompt[:cap]
        if type(reply) is str and len(reply) > cap:
            reply_chars = len(reply)
            reply = reply[:cap]
        return prompt, reply, prompt_chars, reply_chars

    def redact(self, rows: Sequence[Row]) -> list[Row]:
        """``rows`` with each :class:`Unredacted` cell put through the default detectors
        and cut to the cap. Blocking, CPU by the character (8 KB of prose ~1.5 ms, of
        numbers and addresses up to ~50 ms, a side): the writer runs it in its thread,
        never on the event loop, which gets the GIL back at each switch interval (5 ms).

        A text that was cut is rewritten as a stream without its end: the held-back
        tail (where a number or an address may have been cut in half) is left out, so
        the stored text may be a little shorter than the cap, never a partial number.
        A cell the detectors fail on is stored as NULL, not as it came.
        """
        rewriter = self.redactor
        cap = self.max_chars
        out: list[Row] = []
        for row in rows:
            if type(row[_PROMPT]) is not Unredacted and type(row[_REPLY]) is not Unredacted:
                out.append(row)
                continue
            cells = list(row)
            for text_at, chars_at in ((_PROMPT, _PROMPT_CHARS), (_REPLY, _REPLY_CHARS)):
                cell = cells[text_at]
                if type(cell) is not Unredacted:
                    continue
                try:
                    assert rewriter is not None  # only a builder with one makes these
                    if cell.cut:
                        text = rewriter.stream().feed(cell.text)
                    else:
                        text = rewriter.rewrite(cell.text)
                except Exception:
                    cells[text_at] = None
                    continue
                if len(text) > cap:
                    # The tokens may make a short text longer: the row then says so.
                    cells[chars_at] = cells[chars_at] or len(text)
                    text = text[:cap]
                cells[text_at] = text
            out.append(tuple(cells))
        return out


def _redacts(route: Route | None) -> tuple[bool, bool]:
    """Whether the route's own ``gdpr-redact`` redacts the prompt, the reply."""
    return (False, False) if route is None else redacted_sides(route.policies)


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
