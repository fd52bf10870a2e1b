"""JSON-RPC 2.0 as ``/mcp`` receives and answers it (sans-IO, msgspec).

:func:`parse` turns a request body into messages -- or into the error each bad one
gets: -32700 for a body that is not JSON, -32600 for a message that is not a
JSON-RPC request (or an empty or oversized batch). Methods and parameters are the
caller's to check (-32601, -32602). Replies are encoded here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
#: The deadline passed (the SDKs' ``REQUEST_TIMEOUT``).
REQUEST_TIMEOUT = -32001
#: The caller's grants do not cover the tool.
NOT_GRANTED = -32003
#: The upstream server is down, died during the call or answered garbage.
UPSTREAM_FAILED = -32010
#: The key's calls per minute are spent.
RATE_LIMITED = -32029

RequestId = str | int | None
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Message:
    """One request (``id`` set) or notification (``notification``) from the client."""

    method: str
    params: dict[str, Any]
    id: RequestId = None
    notification: bool = False


@dataclass(frozen=True, slots=True)
class Reply:
    """A response from the client (to a request the gateway never sends): ignored."""

    id: RequestId


class RpcError(Exception):
    """A JSON-RPC error for one message (its ``id`` may be unknown: null)."""

    def __init__(self, code: int, message: str, data: Any = None, *, id: RequestId = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.id = id

    def payload(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err


def parse(body: bytes, max_batch: int) -> tuple[list[Message | Reply | RpcError], bool]:
    """The messages of ``body``, in order, and whether it was a batch.

    A message that is not a valid request is its :class:`RpcError` in the list (with
    its id when it had a usable one), so the others of a batch are still answered.

    Raises:
        RpcError: -32700 (not JSON), -32600 (an empty batch, one of more than
            ``max_batch`` messages, or a body that is neither an object nor an array).
    """
    try:
        raw = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RpcError(PARSE_ERROR, f"parse error: the body is not JSON ({exc})") from None
    if isinstance(raw, list):
        if not raw:
            raise RpcError(INVALID_REQUEST, "invalid request: an empty batch")
        if len(raw) > max_batch:
            raise RpcError(
                INVALID_REQUEST,
                f"invalid request: a batch of {len(raw)} messages (at most {max_batch})",
            )
        return [_message(m) for m in raw], True
    if not isinstance(raw, dict):
        raise RpcError(INVALID_REQUEST, "invalid request: a JSON-RPC message is an object")
    return [_message(raw)], False


def _valid_id(value: Any) -> bool:
    return (isinstance(value, str) and len(value) <= 256) or (
        isinstance(value, int) and not isinstance(value, bool) and -(2**53) <= value < 2**53
    )


def _message(raw: Any) -> Message | Reply | RpcError:
    if not isinstance(raw, dict):
        return RpcError(INVALID_REQUEST, "invalid request: a JSON-RPC message is an object")
    has_id = "id" in raw
    rid = raw.get("id")
    if has_id and rid is not None and not _valid_id(rid):
        return RpcError(INVALID_REQUEST, "invalid request: `id` must be a string or an integer")
    if raw.get("jsonrpc") != "2.0":
        return RpcError(INVALID_REQUEST, 'invalid request: `jsonrpc` must be "2.0"', id=rid)
    method = raw.get("method")
    if method is None and has_id and ("result" in raw or "error" in raw):
        return Reply(rid)
    if not isinstance(method, str) or not method:
        return RpcError(INVALID_REQUEST, "invalid request: `method` must be a string", id=rid)
    params = raw.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return RpcError(INVALID_PARAMS, "invalid params: `params` must be an object", id=rid)
    if has_id and rid is None:
        return RpcError(INVALID_REQUEST, "invalid request: `id` must not be null", id=None)
    return Message(method[:200], params, rid, notification=not has_id)


def result(rid: RequestId, value: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": value}


def error(err: RpcError, rid: RequestId | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": err.id if rid is None else rid, "error": err.payload()}


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def decode(line: bytes | memoryview | str) -> Any:
    """One message of an upstream (raises msgspec.DecodeError)."""
    return _decoder.decode(line)
