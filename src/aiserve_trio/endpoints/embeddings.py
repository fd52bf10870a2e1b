"""``POST /v1/embeddings`` on a route of ``kind = "embeddings"``.

One request, one upstream call: the body is read (size-capped), the fields the
gateway acts on are checked (``model`` served by the route, ``input`` a string,
strings, or token arrays), and the client's body goes to the route's adapter
as it was sent -- only ``model`` may be mapped. The backend's JSON answer is
relayed as it came. The request has one deadline (``X-Request-Timeout-Ms``,
capped by the route), and the same auth, rate limits and metrics as chat: the
route's endpoint takes a request slot and the chat auth level, and the outcome
goes to the event hook like a chat request's.
"""

from __future__ import annotations

import secrets

import msgspec
import trio

from ..adapters.base import EmbeddingRequest, Usage
from ..config import Config
from ..core.budgets import TIMEOUT_HEADER, effective_timeout_ms
from ..core.errors import BadRequest, Forbidden, GatewayError, NotFound, StageDeadlineExceeded
from ..http.body import read_body
from ..http.endpoints import Request
from ..http.types import JSON_HEADERS
from ..observability.metrics import status_label
from ..spend.prices import decimal
from ..stages.outcome import Outcome, RequestHook
from ..stages.parse import check_content_type, check_depth
from ..stages.types import Route
from ..util.vectors import embedding_inputs

_raw_body = msgspec.json.Decoder(dict[str, msgspec.Raw])
class _Counted(msgspec.Struct):
    prompt_tokens: int = 0


class _Answer(msgspec.Struct):
    usage: _Counted | None = None


_answer = msgspec.json.Decoder(_Answer)


def check_input(raw: msgspec.Raw | None) -> None:
    """``input`` must be a string, a list of strings, or token arrays, and not empty.

    Raises:
        BadRequest: naming ``input``.
    """
    if raw is None:
        raise BadRequest("`input` is required", param="input", code="missing_required_parameter")
    try:
        embedding_inputs(msgspec.json.decode(raw))
    except (ValueError, TypeError, msgspec.DecodeError) as exc:
        raise BadRequest(str(exc), param="input", code="invalid_type") from None


class Embeddings:
    """Serves the embeddings routes of one app."""

    def __init__(self, config: Config, hook: RequestHook) -> None:
        self.config = config
        self.hook = hook

    async def serve(self, route: Route, request: Request) -> Outcome:
        """Answer one request (errors as the OpenAI envelope); report and return its outcome."""
        request_id = f"embd-{secrets.token_hex(12)}"
        extra = [(b"x-request-id", request_id.encode())]
        model = ""
        prompt_tokens: int | None = None
        cost = 0.0
        error: GatewayError | None = None
        try:
            model, prompt_tokens, cost = await self._answer(route, request, request_id, extra)
        except GatewayError as err:
            error = err
            if not request.responder.started:
                await request.responder.error(err, extra)
        usage = None
        principal = request.principal
        if prompt_tokens is not None:
            usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0)
        outcome = Outcome(
            request_id=request_id,
            route=route.label,
            channel="api",
            arrival=request.arrival,
            ended=trio.current_time(),
            status="ok" if error is None else status_label(error.status),
            model=model,
            error=error,
            error_stage=None if error is None else "inference",
            usage=usage,
            finish_reason=None if error is not None else "stop",
            tenant=principal.tenant if principal is not None else route.tenant,
            key_id=principal.key_id if principal is not None else None,
            served_model=model,
            cost=cost,
        )
        self.hook.request_complete(outcome)
        return outcome

    async def _answer(
        self,
        route: Route,
        request: Request,
        request_id: str,
        extra: list[tuple[bytes, bytes]],
    ) -> tuple[str, int | None, float]:
        cfg = self.config
        d, rd = cfg.deadline, route.config.deadline
        timeout_ms = effective_timeout_ms(
            request.headers.get(TIMEOUT_HEADER),
            default_ms=rd.default_ms or d.default_ms,
            max_ms=rd.max_ms or d.max_ms,
            reserve_ms=d.reserve_ms,
        )
        deadline = request.arrival + (timeout_ms - d.reserve_ms) / 1000.0
        check_content_type(request.headers.get("content-type"))
        body: bytes | None = None
        with trio.move_on_at(deadline):
            body = await read_body(request.receive, cfg.limits.max_body_bytes)
        if body is None:
            raise StageDeadlineExceeded("parse", "the request body did not arrive in time")
        if not body:
            raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
        check_depth(body, cfg.limits.max_json_depth)
        try:
            fields = _raw_body.decode(body)
        except msgspec.DecodeError as exc:
            why = f"request body is not valid JSON: {exc}"
            raise BadRequest(why, code="invalid_json") from None
        model = _model(fields.get("model")) or route.config.default_model
        adapter = route.adapter
        if not model:
            raise BadRequest("`model` is required", param="model")
        if model not in adapter.models:
            raise NotFound(
                f"the model {model!r} is not served on this route "
                f"(models: {', '.join(adapter.models)})",
                param="model",
                code="model_not_found",
            )
        allowed = request.principal.models if request.principal is not None else None
        if allowed is not None and model not in allowed:
            # A database key's (or its team's) model allow-list (issue 47, item 3).
            raise Forbidden(
                f"this API key may not call the model {model!r} "
                f"(its models: {', '.join(sorted(allowed)) or 'none'})",
                param="model",
                code="model_not_allowed",
            )
        check_input(fields.get("input"))
        if not adapter.capabilities.embeddings:
            raise BadRequest(
                f"the backend of this route ({adapter.name}) does not answer embeddings",
                code="unsupported_endpoint",
            )
        headers = request.headers
        forward: dict[str, str] = {
            k: headers[k] for k in ("traceparent", "tracestate") if k in headers
        }
        call = EmbeddingRequest(
            request_id=request_id,
            model=model,
            deadline=deadline,
            body={**fields, "model": msgspec.Raw(msgspec.json.encode(model))},
            forward_headers=forward,
        )
        answer: bytes | None = None
        with trio.move_on_at(deadline):
            answer = await adapter.embed(call)
        if answer is None:
            raise StageDeadlineExceeded("inference", "the embeddings did not arrive in time")
        tokens = _prompt_tokens(answer)
        cost = 0.0
        if route.pricing is not None and tokens is not None:
            cost = route.pricing.cost(model, Usage(prompt_tokens=tokens, completion_tokens=0))
            extra = [*extra, (b"x-aiserve-cost", decimal(cost).encode())]
        await request.responder.complete(200, [*JSON_HEADERS, *extra], answer)
        return model, tokens, cost


def _model(raw: msgspec.Raw | None) -> str | None:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=str)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise BadRequest("`model` must be a string", param="model", code="invalid_type") from None


def _prompt_tokens(answer: bytes) -> int | None:
    try:
        usage = _answer.decode(answer).usage
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return usage.prompt_tokens if usage is not None else None
