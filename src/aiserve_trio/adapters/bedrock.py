"""The ``bedrock`` adapter: Amazon Bedrock's Converse API, streamed.

``POST {base_url}/model/{modelId}/converse-stream``, signed with AWS Signature
Version 4 by botocore's own signer (``SigV4Auth``, service ``bedrock``, the
adapter's ``region``); the credentials come from the standard chain -- the AWS
environment variables, or the named ``profile`` -- resolved once when the adapter
opens (in a thread: the chain may read files or ask the instance metadata
service) and refreshed in a thread when they are about to expire. With
``api_key_env`` the request carries a Bedrock API key as a bearer token instead.
``region`` sets the default endpoint (``https://bedrock-runtime.{region}.amazonaws.com``);
``base_url`` overrides it. botocore is the ``bedrock`` extra
(``pip install 'aiserve-trio[bedrock]'``): the gateway does not need it otherwise,
and an adapter of this kind without it is a start-up error naming the extra.

The reply is the binary AWS event stream, decoded with its CRCs checked
(``eventstream.py``, ``bedrock_stream.py``). The chat request is translated (pure:
:func:`converse_body`):

======================================  ===============================================
chat request                            Converse
======================================  ===============================================
``system`` / ``developer`` messages     ``system[].text``
``user`` text, ``text`` parts           ``messages[]`` ``role: user``, ``content[].text``
``image_url`` parts (``data:`` URLs)    ``content[].image`` (``format``, ``source.bytes``)
``assistant`` content, ``tool_calls``   ``role: assistant``, ``text`` and ``toolUse``
                                        (``toolUseId``, ``name``, ``input``)
``tool`` messages                       ``role: user``, ``toolResult`` (``toolUseId``,
                                        ``content[].text``)
``tools`` (functions)                   ``toolConfig.tools[].toolSpec`` (``inputSchema.json``)
``tool_choice`` auto/required/fn        ``toolConfig.toolChoice`` ``auto``/``any``/``tool``
``max_tokens``, ``temperature``,        ``inferenceConfig.maxTokens``, ``temperature``,
``top_p``, ``stop``                     ``topP``, ``stopSequences``
======================================  ===============================================

Refused with a 400 naming the field: ``tool_choice: "none"`` (Converse has no such
choice), images by ``http(s)`` URL (Converse takes bytes). Errors: a 429
(``ThrottlingException``), 500, 503 and ``ModelNotReadyException`` are retried
before the first token; a ``ValidationException`` about the input's length is
``context_length_exceeded``, any other the client's 400.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import quote

import httpx2
import msgspec
import trio

from ..core.errors import BadRequest, ConfigError, GatewayError, UpstreamStatusError
from ..core.messages import Message
from ..observability.events import NULL_HOOK, UpstreamHook
from .base import InferenceRequest
from .bedrock_stream import BedrockStreamDecoder
from .native import (
    TRANSLATED,
    Headers,
    Image,
    NativeAdapter,
    StreamDecoder,
    content_parts,
    error_fields,
    one_choice,
    parse_arguments,
    read_tools,
)
from .settings import BedrockAdapterConfig

__all__ = ["BedrockAdapter", "converse_body"]

_enc = msgspec.json.Encoder()
_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/gif": "gif", "image/webp": "webp"}


def _image(image: Image, where: str) -> dict[str, Any]:
    fmt = _FORMATS.get(image.media)
    if not image.data or fmt is None:
        why = "Bedrock takes images as base64 data: URLs (png, jpeg, gif or webp)"
        raise BadRequest(f"`{where}`: {why}", param=where)
    return {"image": {"format": fmt, "source": {"bytes": image.data}}}


def _text(text: str) -> dict[str, Any]:
    return {"text": text}


def _messages(messages: list[Message]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role in ("system", "developer"):
            if m.text():
                system.append({"text": m.text()})
            continue
        if m.role == "tool":
            role = "user"
            result = {"toolUseId": m.tool_call_id or "", "content": [{"text": m.text()}]}
            blocks: list[dict[str, Any]] = [{"toolResult": result}]
        elif m.role in ("user", "assistant"):
            role = m.role
            blocks = content_parts(m, i, "Bedrock", _text, _image)
            for k, call in enumerate(m.tool_calls or []):
                where = f"messages[{i}].tool_calls[{k}].function.arguments"
                use = {
                    "toolUseId": call.id,
                    "name": call.function.name,
                    "input": parse_arguments(call.function.arguments, where),
                }
                blocks.append({"toolUse": use})
        else:
            raise BadRequest(
                f"`messages[{i}].role`: {m.role!r} cannot be sent to Bedrock",
                param=f"messages[{i}].role",
            )
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def converse_body(request: InferenceRequest) -> bytes:
    """The Converse body for ``request`` (see the module docstring's table).

    Raises:
        BadRequest: what Converse cannot be told (``tool_choice: "none"``, an image
            by URL, a tool call's arguments that are not JSON, an unknown role).
    """
    system, turns = _messages(request.messages)
    body: dict[str, Any] = {"messages": turns}
    if system:
        body["system"] = system
    inference: dict[str, Any] = {}
    if request.max_tokens is not None:
        inference["maxTokens"] = request.max_tokens
    if request.temperature is not None:
        inference["temperature"] = request.temperature
    if request.top_p is not None:
        inference["topP"] = request.top_p
    if request.stop:
        inference["stopSequences"] = request.stop
    if inference:
        body["inferenceConfig"] = inference
    choice = request.tool_choice
    if choice == "none":
        raise BadRequest(
            '`tool_choice`: Bedrock\'s Converse API has no "none"; leave out `tools` instead',
            param="tool_choice",
        )
    tools = read_tools(request)
    if tools is not None:
        specs = [
            {
                "toolSpec": {
                    "name": name,
                    **({"description": description} if description else {}),
                    "inputSchema": {"json": params or {"type": "object", "properties": {}}},
                }
            }
            for name, description, params in tools
        ]
        config: dict[str, Any] = {"tools": specs}
        if choice == "required":
            config["toolChoice"] = {"any": {}}
        elif choice is not None and choice != "auto":
            config["toolChoice"] = {"tool": {"name": choice}}
        body["toolConfig"] = config
    return _enc.encode(body)


def _botocore() -> Any:
    """botocore's modules the adapter uses (the ``bedrock`` extra).

    Raises:
        ConfigError: botocore is not installed.
    """
    try:
        import botocore.auth
        import botocore.awsrequest
        import botocore.session
    except ImportError:
        raise ConfigError(
            "adapters of kind = \"bedrock\" sign with botocore: pip install 'aiserve-trio[bedrock]'"
        ) from None
    return botocore


class BedrockAdapter(NativeAdapter):
    """Streams Bedrock Converse replies as chat deltas."""

    capabilities = TRANSLATED

    def __init__(
        self,
        name: str,
        config: BedrockAdapterConfig,
        *,
        hook: UpstreamHook = NULL_HOOK,
        rng: random.Random | None = None,
    ) -> None:
        self.bedrock = config
        super().__init__(name, config, hook=hook, rng=rng)
        self._credentials: Any = None
        self._botocore: Any = None
        url = httpx2.URL(self.base_url.rstrip("/"))
        name = f"[{url.host}]" if ":" in url.host else url.host  # an IPv6 literal
        self._host = name if url.port is None else f"{name}:{url.port}"

    def default_base_url(self) -> str:
        return f"https://bedrock-runtime.{self.bedrock.region}.amazonaws.com"

    def auth_headers(self) -> Headers:
        out = [(b"accept", b"application/vnd.amazon.eventstream")]
        if self.config.api_key_env:
            key = self.env(self.config.api_key_env, "api_key_env")
            out.append((b"authorization", b"Bearer " + key.encode()))
        return out

    async def aopen(self, nursery: trio.Nursery) -> None:
        """The transport, and the AWS credentials from the standard chain (unless a key is used).

        Raises:
            ConfigError: botocore is missing, or no credentials are found.
        """
        if not self.config.api_key_env:
            boto = self._botocore = _botocore()
            profile = self.bedrock.profile
            try:
                session = boto.session.Session(profile=profile)
                creds = await trio.to_thread.run_sync(session.get_credentials)
            except Exception as exc:  # botocore's profile and provider errors
                raise ConfigError(f"adapter {self.name}: AWS credentials: {exc}") from None
            if creds is None:
                where = (
                    f"profile {profile!r}" if profile else "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
                )
                raise ConfigError(f"adapter {self.name}: no AWS credentials found ({where})")
            self._credentials = creds
        await super().aopen(nursery)

    def exchange(self, request: InferenceRequest, model: str) -> tuple[str, Headers, bytes]:
        one_choice(request)
        return f"/model/{quote(model, safe='')}/converse-stream", [], converse_body(request)

    async def signed(self, path: str, body: bytes) -> Headers:
        """SigV4 headers for ``POST base_url + path`` with ``body`` (none with an API key)."""
        creds = self._credentials
        if creds is None:
            return []
        refresh = getattr(creds, "refresh_needed", None)
        if refresh is not None and refresh():
            frozen = await trio.to_thread.run_sync(creds.get_frozen_credentials)
        else:
            frozen = creds.get_frozen_credentials()
        boto = self._botocore
        url = self.base_url.rstrip("/") + path
        # The Host header as the transport sends it (signed): given here, botocore
        # does not parse the URL for it twice per signature (~100 us).
        fixed = {"host": self._host, "content-type": "application/json"}
        req = boto.awsrequest.AWSRequest(method="POST", url=url, data=body, headers=fixed)
        boto.auth.SigV4Auth(frozen, "bedrock", self.bedrock.region).add_auth(req)
        keep = ("authorization", "x-amz-date", "x-amz-security-token")  # host: the transport's
        return [
            (k.lower().encode(), str(v).encode())
            for k, v in req.headers.items()
            if k.lower() in keep
        ]

    def decoder(self) -> StreamDecoder:
        return BedrockStreamDecoder(self.name)

    def status_error(self, status: int, raw: bytes, retry_after: float | None) -> GatewayError:
        kind, message = error_fields(raw)
        kind = kind.rsplit("#", 1)[-1].split(":", 1)[0]
        said = f"{self.name}: Bedrock answered {status} {kind}: {message[:300]}"
        if status == 400 or kind == "ValidationException":
            if "too long" in message or "too many" in message or "exceeds" in message:
                return BadRequest(said, param="messages", code="context_length_exceeded")
            return BadRequest(said, code="invalid_request_error")
        return UpstreamStatusError(said, upstream_status=status, retry_after=retry_after)
