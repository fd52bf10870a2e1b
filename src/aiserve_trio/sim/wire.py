"""The messages a reply is sent as (pure): SSE chunk choices, the JSON body, WebSocket messages.

A reply is ``plan.tokens`` output tokens, numbered ``k``: the reasoning
pieces first, then the visible ones (content, or a tool call's arguments).
Each function here renders one of them, or the reply's end, as dicts for the
shell in :mod:`.app` / :mod:`.ws` to encode and pace.
"""

from __future__ import annotations

from typing import Any

from .model import Plan
from .reply import Script, logprob_entry, usage


def sse_choices(script: Script, k: int, top: int | None) -> list[dict[str, Any]]:
    """The ``choices`` of each chunk output token ``k`` is sent as (usually one chunk).

    The first chunk's delta carries ``role``. A tool call's first fragment is
    preceded by the chunk that names the call (``id``, ``name``, empty
    ``arguments``), as OpenAI streams it.

    Args:
        top: ``top_logprobs`` when ``logprobs`` was asked for, else ``None``.
    """
    r = len(script.reasoning)
    out: list[dict[str, Any]] = []
    if k < r:
        out.append(_choice({"reasoning_content": script.reasoning[k]}))
    else:
        i = k - r
        piece = script.piece(i)
        if script.tool is not None:
            if i == 0:
                head = {
                    "index": 0,
                    "id": script.tool.call_id,
                    "type": "function",
                    "function": {"name": script.tool.name, "arguments": ""},
                }
                out.append(_choice({"tool_calls": [head]}))
            frag = {"index": 0, "function": {"arguments": piece}}
            out.append(_choice({"tool_calls": [frag]}))
        else:
            choice = _choice({"content": piece})
            if top is not None:
                choice["logprobs"] = {"content": [logprob_entry(piece, i, top)]}
            out.append(choice)
    if k == 0:
        out[0]["delta"] = {"role": "assistant", **out[0]["delta"]}
    return out


def _choice(delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "finish_reason": None}


def sse_finish(script: Script, plan: Plan) -> dict[str, Any]:
    """The choice of the chunk that ends the reply (empty delta, the finish reason)."""
    return {"index": 0, "delta": {}, "finish_reason": script.finish_reason(plan)}


def reply_usage(plan: Plan, prompt: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` of a reply; ``cached``: of the ``prompt``, the tokens read from
    the prompt cache (:mod:`.prompt_cache`)."""
    return usage(prompt, plan.tokens, plan.reasoning, cached)


def completion_body(
    cid: str,
    model: str,
    script: Script,
    plan: Plan,
    prompt: int,
    top: int | None,
    cached: int = 0,
) -> dict[str, Any]:
    """The ``chat.completion`` JSON body of a reply that is not streamed."""
    n = plan.visible
    message: dict[str, Any] = {"role": "assistant"}
    if script.tool is not None:
        message["content"] = None
        message["tool_calls"] = [
            {
                "id": script.tool.call_id,
                "type": "function",
                "function": {"name": script.tool.name, "arguments": script.visible_text(n)},
            }
        ]
    else:
        message["content"] = script.visible_text(n)
    if script.reasoning:
        message["reasoning_content"] = "".join(script.reasoning)
    choice: dict[str, Any] = {"index": 0, "message": message}
    if top is not None:
        entries = (
            [logprob_entry(script.piece(i), i, top) for i in range(n)]
            if script.tool is None
            else None
        )
        choice["logprobs"] = {"content": entries}
    choice["finish_reason"] = script.finish_reason(plan)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": reply_usage(plan, prompt, cached),
    }


def ws_messages(rid: str, script: Script, k: int) -> list[dict[str, Any]]:
    """The WebSocket messages output token ``k`` is sent as (usually one).

    ``reasoning`` for the reasoning pieces; ``token`` (``index`` counts the
    content tokens from 0) for content; ``tool_call`` for a call's arguments,
    the first one preceded by the message that names the call.
    """
    r = len(script.reasoning)
    if k < r:
        return [{"type": "reasoning", "id": rid, "text": script.reasoning[k]}]
    i = k - r
    piece = script.piece(i)
    if script.tool is None:
        return [{"type": "token", "id": rid, "index": i, "text": piece}]
    frag = {"type": "tool_call", "id": rid, "index": 0, "arguments": piece}
    if i:
        return [frag]
    head = {
        "type": "tool_call",
        "id": rid,
        "index": 0,
        "call_id": script.tool.call_id,
        "name": script.tool.name,
        "arguments": "",
    }
    return [head, frag]


def ws_done(rid: str, script: Script, plan: Plan, prompt: int) -> dict[str, Any]:
    return {
        "type": "done",
        "id": rid,
        "finish_reason": script.finish_reason(plan),
        "usage": reply_usage(plan, prompt),
    }
