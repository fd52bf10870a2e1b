"""Tools, reasoning, content parts and their limits through the gateway, on the built-in mock."""

from __future__ import annotations

import json
from typing import Any

from aiserve_trio.adapters.mock import MockAdapter
from aiserve_trio.config import MockAdapterConfig, parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, Response
from .conftest import config_text, make_config
from .fakes import RecordingAdapter

AGENT = r"""
[adapters.agent]
kind = "mock"
models = ["agent-mock"]
ttft_ms = 10
inter_token_ms = 5

[[adapters.agent.rules]]
pattern = 'weather in (?P<city>\w+)'
reply = "I cannot look that up."
reasoning = "The user wants the weather in {city}."
tool_call = { name = "get_weather", arguments = '{"city": "{city}"}' }

[[adapters.agent.rules]]
pattern = 'contact support'
reply = "No mail tool."
tool_call = { name = "send_mail", arguments = '{"to": "help@bank.example.com", "note": "card 4111 1111 1111 1111", "n": 3}' }

[[adapters.agent.rules]]
pattern = '"temp": ?(?P<temp>-?\d+)'
reply = "It is {temp} degrees."

[[routes]]
path = "/v1/agent"
adapter = "agent"
policies = ["gdpr-redact"]
"""
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "send_mail", "parameters": {"type": "object"}}},
]


def agent_app() -> tuple[App, RecordingAdapter]:
    cfg = make_config(AGENT)
    mock_cfg = cfg.adapters["agent"]
    assert isinstance(mock_cfg, MockAdapterConfig)
    rec = RecordingAdapter(MockAdapter("agent", mock_cfg))
    return App(cfg, adapters={"agent": rec}), rec


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "agent-mock", "messages": list(messages), **extra}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def chunks(r: Response) -> list[dict[str, Any]]:
    return [json.loads(e) for e in r.events() if e != "[DONE]"]


def deltas(r: Response) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks(r) if c["choices"]]


async def test_a_streamed_tool_call_with_reasoning_first(autojump_clock: Any) -> None:
    app, _ = agent_app()
    r = await Client(app).request(
        "POST",
        "/v1/agent",
        json_body=body(user("what is the weather in Paris?"), tools=TOOLS, stream=True),
    )
    assert r.status == 200
    ds = deltas(r)
    reasoning = "".join(d.get("reasoning_content") or "" for d in ds)
    assert reasoning == "The user wants the weather in Paris."
    calls = [c for d in ds for c in d.get("tool_calls") or []]
    first = calls[0]
    assert (first["index"], first["type"], first["function"]["name"]) == (0, "function", "get_weather")
    assert first["id"].startswith("call_")
    assert all("id" not in c for c in calls[1:])  # the id comes once, with the name
    args = "".join(c["function"].get("arguments", "") for c in calls)
    assert json.loads(args) == {"city": "Paris"}
    # No reasoning after the call begins (the redaction filter's held-back tail
    # goes out with the call's first chunk at the latest).
    last_reasoning = max(i for i, d in enumerate(ds) if d.get("reasoning_content"))
    first_call = min(i for i, d in enumerate(ds) if d.get("tool_calls"))
    assert last_reasoning <= first_call
    finishes = [c["choices"][0]["finish_reason"] for c in chunks(r) if c["choices"]]
    assert finishes[-1] == "tool_calls"


async def test_a_function_calling_round_trip_kept_by_the_session(autojump_clock: Any) -> None:
    app, rec = agent_app()
    client = Client(app)
    sid = {"X-Session-Id": "s-tools", "X-Channel": "app"}
    q = user("weather in Oslo please")
    first = await client.request("POST", "/v1/agent", json_body=body(q, tools=TOOLS), headers=sid)
    msg = first.json()["choices"][0]["message"]
    assert first.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    result = {
        "role": "tool",
        "tool_call_id": call["id"],
        "content": '{"temp": -3, "station": "owner ops@example.com"}',
    }
    second = await client.request(
        "POST",
        "/v1/agent",
        json_body=body(q, msg, result, tools=TOOLS),
        headers={**sid, "X-Channel": "wechat"},
    )
    assert second.json()["choices"][0]["message"]["content"] == "It is -3 degrees."
    # The tool result reached the model redacted (gdpr-redact on the route).
    sent = rec.requests[-1].messages
    assert "ops@example.com" not in sent[-1].text()
    assert "[EMAIL]" in sent[-1].text()
    # The session holds the whole exchange, tool call and tool result included.
    view = (await client.request("GET", "/v1/sessions/s-tools")).json()
    roles = [t["role"] for t in view["turns"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    stored_call = view["turns"][1]["tool_calls"][0]
    assert (stored_call["id"], stored_call["function"]["name"]) == (call["id"], "get_weather")
    assert view["turns"][2]["tool_call_id"] == call["id"]
    assert "[EMAIL]" in view["turns"][2]["content"]
    # On the phone line, the model sees the call and its result as history.
    await client.request(
        "POST", "/v1/agent", json_body=body(user("thanks")), headers={**sid, "X-Channel": "ivr"}
    )
    history = rec.requests[-1].messages
    assert [m.role for m in history[-5:]] == ["user", "assistant", "tool", "assistant", "user"]
    assert history[-4].tool_calls is not None
    assert history[-4].tool_calls[0].id == call["id"]


async def test_tool_call_arguments_are_redacted_and_stay_json(autojump_clock: Any) -> None:
    app, _ = agent_app()
    r = await Client(app).request(
        "POST",
        "/v1/agent",
        json_body=body(user("please contact support"), tools=TOOLS, stream=True),
    )
    calls = [c for d in deltas(r) for c in d.get("tool_calls") or []]
    args = "".join(c["function"].get("arguments", "") for c in calls)
    assert "example.com" not in r.body.decode()
    # The card's digits in any grouping ("4111" alone may be part of a `created` time).
    assert "4111 1111" not in r.body.decode()
    assert "41111111" not in r.body.decode().replace(" ", "")
    assert json.loads(args) == {"to": "[EMAIL]", "note": "card [CARD]", "n": 3}


async def test_tool_choice_none_gets_text(autojump_clock: Any) -> None:
    app, _ = agent_app()
    r = await Client(app).request(
        "POST", "/v1/agent", json_body=body(user("weather in Rome"), tools=TOOLS, tool_choice="none")
    )
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "I cannot look that up."
    assert "tool_calls" not in message
    assert message["reasoning_content"] == "The user wants the weather in Rome."


async def test_what_the_mock_cannot_carry_is_a_400_naming_it(autojump_clock: Any) -> None:
    app, rec = agent_app()
    client = Client(app)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    r = await client.request(
        "POST",
        "/v1/agent",
        json_body=body({"role": "user", "content": [{"type": "text", "text": "hi"}, image]}),
    )
    err = r.json()["error"]
    assert (r.status, err["param"], err["code"]) == (
        400,
        "messages[0].content[1]",
        "unsupported_content",
    )
    r = await client.request("POST", "/v1/agent", json_body=body(user("hi"), logprobs=True))
    assert (r.status, r.json()["error"]["param"]) == (400, "logprobs")
    assert rec.calls == 0  # refused before anything reached the model


async def test_deep_nesting_is_a_400_and_the_server_keeps_serving(autojump_clock: Any) -> None:
    app, _ = agent_app()
    client = Client(app)
    deep = b'{"model":"agent-mock","messages":[{"role":"user","content":"hi"}],"x":'
    deep += b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = await client.request(
        "POST", "/v1/agent", body=deep, headers={"content-type": "application/json"}
    )
    assert (r.status, r.json()["error"]["code"]) == (400, "invalid_json")
    assert "nested" in r.json()["error"]["message"]
    ok = await client.request("POST", "/v1/agent", json_body=body(user("weather in Rome")))
    assert ok.status == 200


async def test_an_oversized_part_is_a_413_naming_it(make_app: Any, autojump_clock: Any) -> None:
    app = make_app("\n[adapters.up]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\n"
                   "models = [\"m\"]\n\n[[routes]]\npath = \"/v1/up\"\nadapter = \"up\"\n")
    big = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5_300_000}}
    r = await Client(app).request(
        "POST",
        "/v1/up",
        json_body={"model": "m", "messages": [{"role": "user", "content": [big]}]},
    )
    err = r.json()["error"]
    assert (r.status, err["param"], err["code"]) == (
        413,
        "messages[0].content[0]",
        "content_part_too_large",
    )


PROTECTED = """
[sessions]
backend = "memory"
clear_vars = ["loan_term"]

[[routes]]
path = "/v1/protected"
adapter = "mock"
policies = ["gdpr-redact"]
"""


async def test_session_variables_are_redacted_like_the_messages(make_app: Any, autojump_clock: Any) -> None:


    text = config_text().replace('[sessions]\nbackend = "memory"\n', "")
    app = App(parse_config(text + PROTECTED, source="<test>"))
    client = Client(app)
    sid = {"X-Session-Id": "s-vars"}
    secrets_ = {
        "iban": "GB82 WEST 1234 5698 7654 32",
        "resident_id": "11010519491231002X",
        "phone": "+86 138 0013 8000",
        "loan_term": "20 years, call +86 138 0013 8000",
    }
    r = await client.request(
        "POST",
        "/v1/protected",
        json_body={"model": "aiserve-mock", "messages": [user("echo: hi")], "metadata": secrets_},
        headers=sid,
    )
    assert r.status == 200
    r = await client.request(
        "PUT",
        "/v1/sessions/s-vars/vars",
        json_body={"email": "ann@example.com"},
        headers=sid,
    )
    assert r.status == 200
    stored = (await client.request("GET", "/v1/sessions/s-vars")).json()["variables"]
    assert stored["iban"] == "[IBAN]"
    assert stored["resident_id"] == "[ID]"
    assert "13800138000" not in stored["phone"].replace(" ", "")
    assert stored["email"] == "[EMAIL]"
    # Allowlisted by name in [sessions] clear_vars: kept as sent (and visible in the config).
    assert stored["loan_term"] == secrets_["loan_term"]
