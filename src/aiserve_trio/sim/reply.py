"""What a reply says, decided from the request (pure): text, JSON, or a tool call.

:func:`script_for` reads the request's features the way a model would act on
them, in this order:

0. ``tools`` with ``tool_choice`` not ``"none"``, and the last message is a
   user message with a line ``sim-call: NAME {"json": "object"}`` -> a call
   of ``NAME`` with exactly those arguments (``{}`` when none are given), so
   a test can make an agent (Claude Code, Codex CLI) run a tool it chooses;
1. ``tools`` with ``tool_choice`` not ``"none"`` -> a call of the named
   function (or the first one), with arguments generated from its
   ``parameters`` schema -- unless the last message is a ``tool`` result and
   the choice is ``"auto"`` (or absent), which ends the round trip with text;
2. ``response_format`` ``json_schema`` -> a JSON instance of the schema;
   ``json_object`` -> a small JSON object;
3. the last message is a ``tool`` result -> text quoting it;
4. a classify prompt (a system message with a ``Labels:`` line, as a chain's
   ``classify`` step sends) -> exactly the label the last user message names,
   else ``unknown`` (``util/intents.py``, the rule the gateway's mock follows too);
5. image parts -> text that opens with how many images it saw;
6. otherwise the sim's usual words (:func:`~.model.token_text`).

``reasoning_effort`` adds reasoning pieces before any of these. The timing
(how many of the pieces are sent, and when) is :func:`~.model.plan_reply`'s.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from ..util.intents import simulated_label
from .model import Plan, token_text
from .request import ResponseFormat, SimMessage, Tool, ToolChoice
from .schema import instance

#: Characters per piece when JSON or a long word is split into "tokens".
PIECE_CHARS = 12
#: Reasoning pieces per ``reasoning_effort``; an unknown effort counts as medium.
EFFORT_PIECES = {"none": 0, "minimal": 1, "low": 3, "medium": 6, "high": 12}
_THOUGHT = re.findall(
    r"\s*\S+", "Let me think about what is asked, check the details, and then answer plainly."
)
#: OpenAI allows up to 20 alternatives per token.
MAX_TOP_LOGPROBS = 20
_ALTERNATIVES = (
    *(" sim", " model", " text", " token", " word", " reply", " and", " of", " to", " in"),
    *(" it", " is", " on", " for", " as", " at", " by", " with", " from", " that", " this"),
)
_enc = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    #: The whole arguments JSON text (the pieces of :class:`Script` split it).
    arguments: str


@dataclass(frozen=True, slots=True)
class Script:
    """What one reply says before timing cuts it.

    ``kind`` is ``text`` (``pieces`` open the reply, then the sim's words
    follow for as long as the plan says), ``json`` (the content is exactly
    ``pieces``: JSON, or a classify prompt's label) or ``tool_call``
    (``pieces`` are the arguments of ``tool``).
    """

    kind: str
    pieces: tuple[str, ...] = ()
    reasoning: tuple[str, ...] = ()
    tool: ToolCall | None = None

    @property
    def length(self) -> int | None:
        """The natural length, or ``None`` when the plan chooses it (free text)."""
        return None if self.kind == "text" else len(self.pieces)

    def piece(self, i: int) -> str:
        """The ``i``-th visible piece (content text or arguments fragment)."""
        if i < len(self.pieces):
            return self.pieces[i]
        j = i - len(self.pieces)
        word = token_text(j)
        return " " + word if j == 0 and self.pieces else word

    def visible_text(self, n: int) -> str:
        return "".join(self.piece(i) for i in range(n))

    def finish_reason(self, plan: Plan) -> str:
        if plan.finish_reason == "length":
            return "length"
        return "tool_calls" if self.tool is not None else plan.finish_reason


def split_text(text: str, size: int = PIECE_CHARS) -> tuple[str, ...]:
    """Text as token-like pieces: words with their leading space, long runs cut to ``size``."""
    out: list[str] = []
    for word in re.findall(r"\s*\S+|\s+$", text) or [text]:
        out.extend(word[k : k + size] for k in range(0, len(word), size))
    return tuple(out) or ("",)


def reasoning_pieces(effort: str | None) -> tuple[str, ...]:
    if effort is None:
        return ()
    n = EFFORT_PIECES.get(effort, EFFORT_PIECES["medium"])
    return tuple(_THOUGHT[i % len(_THOUGHT)] for i in range(n))


def call_id(serial: int) -> str:
    """A tool call id: ``call_`` and 24 hex digits, distinct per request, reproducible."""
    return "call_" + hashlib.blake2b(str(serial).encode(), digest_size=12).hexdigest()


def script_for(
    messages: list[SimMessage],
    *,
    tools: list[Tool] | None,
    tool_choice: ToolChoice,
    response_format: ResponseFormat | None,
    reasoning_effort: str | None,
    images: int,
    serial: int,
) -> Script:
    """Decide what the reply to one request says (see the module docstring).

    Args:
        images: the image parts in ``messages`` (counted once by the caller).
        serial: the request's number, for the tool call id.

    Raises:
        SchemaError: a tool's ``parameters`` or the ``json_schema`` has no instance.
    """
    thinking = reasoning_pieces(reasoning_effort)
    last_role = messages[-1].role if messages else "user"
    asked = sim_call(messages[-1].text()) if messages and last_role == "user" else None
    if asked is not None and tools and tool_choice != "none":
        name, args = asked
        tool = ToolCall(call_id=call_id(serial), name=name, arguments=args)
        return Script("tool_call", split_text(args), thinking, tool)
    fn = _chosen_function(tools, tool_choice, last_role)
    if fn is not None:
        name, params, strict = fn
        value = instance(params or {"type": "object"}, strict=strict)
        args = _enc.encode(value).decode()
        tool = ToolCall(call_id=call_id(serial), name=name, arguments=args)
        return Script("tool_call", split_text(args), thinking, tool)
    if response_format is not None and response_format.type == "json_schema":
        js = response_format.json_schema
        schema = js.schema if js is not None and js.schema is not None else {"type": "object"}
        value = instance(schema, strict=bool(js is not None and js.strict))
        return Script("json", split_text(_enc.encode(value).decode()), thinking)
    if response_format is not None and response_format.type == "json_object":
        return Script("json", split_text('{"answer":"sim","ok":true}'), thinking)
    if last_role == "tool":
        results = []
        for m in reversed(messages):
            if m.role != "tool":
                break
            results.append(m.text())
        quote = "; ".join(reversed(results))
        return Script("text", split_text(f"The tool returned: {quote}"), thinking)
    system = "\n".join(m.text() for m in messages if m.role in ("system", "developer"))
    label = simulated_label(system, _last_user(messages)) if system else None
    if label is not None:
        return Script("json", split_text(label), thinking)  # exactly the label, nothing after
    if images:
        plural = "s" if images != 1 else ""
        return Script("text", split_text(f"I see {images} image{plural}."), thinking)
    return Script("text", (), thinking)


_SIM_CALL = re.compile(r"^[ \t]*sim-call:[ \t]*(\S+)[ \t]*(.*?)[ \t]*$", re.MULTILINE)


def sim_call(text: str) -> tuple[str, str] | None:
    """The ``sim-call: NAME {args}`` directive in ``text`` (its last such line): the
    tool's name and its arguments as compact JSON; ``None`` when there is none.

    Raises:
        ValueError: the arguments are not a JSON object.
    """
    found = _SIM_CALL.findall(text)
    if not found:
        return None
    name, raw = found[-1]
    try:
        args = msgspec.json.decode(raw or "{}")
    except msgspec.DecodeError as exc:
        raise ValueError(f"sim-call: {name}: the arguments are not JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError(f"sim-call: {name}: the arguments must be a JSON object")
    return name, _enc.encode(args).decode()


def _last_user(messages: list[SimMessage]) -> str:
    return next((m.text() for m in reversed(messages) if m.role == "user"), "")


def _chosen_function(
    tools: list[Tool] | None, choice: ToolChoice, last_role: str
) -> tuple[str, dict[str, Any] | None, bool] | None:
    """The function to call (name, parameters, strict), or ``None`` to answer with text."""
    funcs = [t.function for t in tools or () if t.function is not None]
    if not funcs or choice == "none":
        return None
    if isinstance(choice, dict):
        named = choice.get("function")
        name = named.get("name") if isinstance(named, dict) else None
        if isinstance(name, str) and name:
            for f in funcs:
                if f.name == name:
                    return f.name, f.parameters, bool(f.strict)
            return name, None, False  # not among the tools: a model would still try
        first = funcs[0]
        return first.name, first.parameters, bool(first.strict)
    if choice != "required" and last_role == "tool":
        return None  # "auto" after a tool result: answer, so the round trip ends
    first = funcs[0]
    return first.name, first.parameters, bool(first.strict)


def logprob_entry(token: str, i: int, top: int) -> dict[str, Any]:
    """One ``logprobs.content`` entry for the ``i``-th content piece, with ``top`` alternatives.

    The chosen token is the likeliest; alternatives are other words, each less
    likely than the one before. Deterministic, so tests can compare.
    """
    lp = -round(0.01 + 0.07 * (i % 5), 4)
    k = max(0, min(top, MAX_TOP_LOGPROBS))
    tops = [token][:k]
    for alt in _ALTERNATIVES[i % len(_ALTERNATIVES) :] + _ALTERNATIVES:
        if len(tops) >= k:
            break
        if alt not in tops:
            tops.append(alt)
    return {
        "token": token,
        "logprob": lp,
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": t, "logprob": round(lp - 1.5 * j, 4), "bytes": list(t.encode())}
            for j, t in enumerate(tops)
        ],
    }


def usage(prompt: int, completion: int, reasoning: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``completion`` includes the ``reasoning`` tokens, ``prompt``
    the ``cached`` ones (read from the prompt cache)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }
