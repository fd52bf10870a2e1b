"""A Responses object echoes the request (``instructions``, ``tools``, ``text.format``,
``metadata``, ``user``): on a route whose input policies redact, it echoes what was sent
upstream, not what the client wrote (issue 51, item 2) -- in the whole body and in the
stream's ``response.created`` and ``response.completed``."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import trio.testing

from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .conftest import make_config

CARD = "4111 1111 1111 1111"
EMAIL = "jane.doe@example.org"
#: What must not come back (the card's digits as a run, too).
TELLS = ("4111 1111", "4111111111111111", "jane.doe", "example.org")

ROUTE = """
[[routes]]
path = "/v1/r"
name = "redacting"
kind = "responses"
adapter = "mock"
default_model = "aiserve-mock"
policies = ["gdpr-redact"]
"""

BODY: dict[str, Any] = {
    "model": "aiserve-mock",
    "input": "echo: fine",
    "instructions": f"The customer pays with {CARD}.",
    "user": EMAIL,
    "metadata": {"card": CARD, "mail": EMAIL},
    "tools": [
        {
            "type": "function",
            "name": "charge",
            "description": f"charges {CARD}",
            "parameters": {"type": "object", "description": f"for {EMAIL}"},
        }
    ],
    "text": {
        "format": {
            "type": "json_schema",
            "name": "receipt",
            "description": f"a receipt for {EMAIL}",
            "schema": {"type": "object", "description": f"card {CARD}"},
        }
    },
}


def app(extra: str = ROUTE) -> App:
    """The default config and ``extra``; its mock carries ``response_format`` (as any
    OpenAI-compatible backend does), so that ``text.format`` is served and echoed."""
    out = App(make_config(extra))
    mock = out.adapters["mock"]
    caps = mock.capabilities
    assert caps.fields is not None
    fields = caps.fields | {"response_format"}
    mock.capabilities = msgspec.structs.replace(caps, fields=fields)
    return out


def leaks(text: str) -> list[str]:
    return [t for t in TELLS if t in text.replace("\\u0040", "@")]


def echoed(response: dict[str, Any]) -> str:
    """The echoed fields of a response object, as JSON."""
    keys = ("instructions", "user", "metadata", "tools", "text")
    assert all(response[k] for k in keys), response  # echoed, not dropped
    return json.dumps({k: response[k] for k in keys})


async def test_the_body_echoes_the_redacted_request(autojump_clock: trio.testing.MockClock):
    r = await Client(app()).request("POST", "/v1/r", json_body=BODY)
    assert r.status == 200, r.body
    response = r.json()
    assert leaks(echoed(response)) == []
    assert leaks(r.body.decode()) == []
    assert response["instructions"] == "The customer pays with [CARD]."


async def test_the_stream_echoes_the_redacted_request(autojump_clock: trio.testing.MockClock):
    body = {**BODY, "stream": True}
    r = await Client(app()).request("POST", "/v1/r", json_body=body)
    assert r.status == 200, r.body
    events = {}
    for block in r.body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                events[data["type"]] = data
    for kind in ("response.created", "response.completed"):
        assert leaks(echoed(events[kind]["response"])) == [], kind
    assert leaks(r.body.decode()) == []


async def test_a_route_without_redaction_echoes_the_request_as_sent(
    autojump_clock: trio.testing.MockClock,
):
    r = await Client(app("")).request("POST", "/v1/responses", json_body=BODY)
    assert r.status == 200, r.body
    response = r.json()
    assert response["instructions"] == BODY["instructions"]
    assert response["metadata"] == BODY["metadata"]
    assert response["user"] == EMAIL
    assert response["tools"] == BODY["tools"]
