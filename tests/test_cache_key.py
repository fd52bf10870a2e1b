"""The cache key (pure): every field that changes the answer changes the key, nothing else does."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import pytest

from aiserve_trio.cache.key import (
    RouteScope,
    adapter_version,
    canonical,
    canonical_bytes,
    deterministic,
    directives,
    policy_version,
    request_key,
)
from aiserve_trio.config import MockAdapterConfig, OpenAIAdapterConfig
from aiserve_trio.policies.compliance import ComplianceSettings

SCOPE = RouteScope(
    route="/v1/chat/completions",
    adapter="up",
    adapter_version="a1",
    policy_version="p1",
    per_channel=False,
)
BASE: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "temperature": 0,
}


def key_of(
    body: dict[str, Any] | bytes,
    *,
    scope: RouteScope = SCOPE,
    tenant: str = "t1",
    channel: str = "api",
    max_tokens: int | None = None,
    variables: dict[str, str] | None = None,
) -> str:
    """The key of a body as the parse stage splits it (messages raw, other fields raw)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    messages = msgspec.json.decode(top["messages"], type=list[msgspec.Raw])
    return request_key(
        scope,
        tenant=tenant,
        channel=channel,
        model=msgspec.json.decode(top["model"]),
        messages=messages,
        fields={k: v for k, v in top.items() if k not in ("model", "messages")},
        max_tokens=max_tokens,
        variables=variables or {},
    )


# Every field the issue lists (and more), each changed from BASE: a different key.
CHANGED: list[tuple[str, dict[str, Any]]] = [
    ("model", {"model": "m2"}),
    ("message text", {"messages": [{"role": "user", "content": "hi!"}]}),
    ("message role", {"messages": [{"role": "system", "content": "hi"}]}),
    ("message name", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}),
    ("another message", {"messages": [{"role": "user", "content": "hi"}] * 2}),
    (
        "text part",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ),
    (
        "image part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                }
            ]
        },
    ),
    (
        "image detail",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,AA==", "detail": "low"},
                        },
                    ],
                }
            ]
        },
    ),
    (
        "tool call in history",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ]
        },
    ),
    ("temperature", {"temperature": 0.5}),
    ("top_p", {"top_p": 0.9}),
    ("seed", {"seed": 7}),
    ("other seed", {"seed": 8}),
    ("stop", {"stop": ["\n"]}),
    ("max_tokens", {"max_tokens": 10}),
    ("max_completion_tokens", {"max_completion_tokens": 10}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("logit_bias", {"logit_bias": {"50256": -100}}),
    ("n", {"n": 1}),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 2}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    (
        "tools",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    ),
    ("tool_choice", {"tool_choice": "none"}),
    ("parallel_tool_calls", {"parallel_tool_calls": False}),
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("a field unknown today", {"x_vendor_knob": 1}),
]


@pytest.mark.parametrize(("what", "change"), CHANGED, ids=[c[0] for c in CHANGED])
def test_any_changed_field_changes_the_key(what: str, change: dict[str, Any]) -> None:
    assert key_of({**BASE, **change}) != key_of(BASE)


def test_the_changed_fields_all_differ_from_each_other() -> None:
    keys = [key_of({**BASE, **change}) for _, change in CHANGED]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize(
    "what",
    ["tenant", "route", "adapter", "adapter version", "policy version", "max_tokens", "vars"],
)
def test_what_the_gateway_adds_changes_the_key(what: str) -> None:
    base = key_of(BASE)
    scopes = {
        "route": dataclasses.replace(SCOPE, route="/v2"),
        "adapter": dataclasses.replace(SCOPE, adapter="other"),
        "adapter version": dataclasses.replace(SCOPE, adapter_version="a2"),
        "policy version": dataclasses.replace(SCOPE, policy_version="p2"),
    }
    if what in scopes:
        assert key_of(BASE, scope=scopes[what]) != base
    elif what == "tenant":
        assert key_of(BASE, tenant="t2") != base
    elif what == "max_tokens":  # the route's cap, sent upstream
        assert key_of(BASE, max_tokens=100) != base
    else:  # the session variables the adapter sees
        assert key_of(BASE, variables={"income": "5000"}) != base


def test_the_channel_counts_only_where_policies_may_answer_per_channel() -> None:
    assert key_of(BASE, channel="web") == key_of(BASE, channel="api")
    policed = dataclasses.replace(SCOPE, per_channel=True)
    assert key_of(BASE, channel="web", scope=policed) != key_of(BASE, channel="api", scope=policed)


@pytest.mark.parametrize("field", ["metadata", "stream_options", "user"])
def test_how_and_to_whom_the_answer_goes_is_not_in_the_key(field: str) -> None:
    value: Any = {"include_usage": True} if field == "stream_options" else {"a": "b"}
    if field == "user":
        value = "alice"
    assert key_of({**BASE, field: value}) == key_of(BASE)


def test_streamed_and_not_share_a_key() -> None:
    assert key_of({**BASE, "stream": True}) == key_of({**BASE, "stream": False}) == key_of(BASE)


def test_key_order_and_whitespace_do_not_matter() -> None:
    compact = (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,'
        b'"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"a":1,"b":2}}}}'
    )
    spaced = (
        b'{ "temperature" : 0.0 ,\n  "messages" : [ { "content" : "h\\u0069", "role" : "user" } ],'
        b'\n "response_format": {"json_schema": {"schema": {"b": 2, "a": 1.0}, "name": "x"},'
        b' "type": "json_schema"}, "model": "m" }'
    )
    assert key_of(spaced) == key_of(compact)


def test_numbers_count_by_value_and_never_collapse() -> None:
    assert canonical_bytes(canonical(b"[1, 1.0, 1e0, 10E-1, -0.0, 0.50, 2.5e1]")) == (
        b"[1,1,1,1,0,0.5,25]"
    )
    # Too large for a float: still a number, not the `null` a float encoder gives inf.
    assert canonical_bytes(canonical(b"1e400")) == b"1E+400"
    assert canonical_bytes(canonical(b"1e400")) != canonical_bytes(canonical(b"null"))
    # A string that looks like a number stays a string.
    assert canonical_bytes(canonical(b'"1.0"')) == b'"1.0"'


def test_a_field_moved_into_a_message_is_another_request() -> None:
    # The key is built from JSON values, never by joining strings.
    a = {**BASE, "messages": [{"role": "user", "content": "hi", "x": 1}]}
    b = {**BASE, "x": 1}
    assert key_of(a) != key_of(b)


def test_policy_version_covers_settings_and_rule_pack_bytes() -> None:
    settings = ComplianceSettings(pack="p.toml")
    v = policy_version([("c", "compliance", settings, b"rules = []")])
    assert v == policy_version([("c", "compliance", settings, b"rules = []")])
    assert v != policy_version([("c", "compliance", settings, b"rules = [1]")])
    assert v != policy_version(
        [("c", "compliance", ComplianceSettings(pack="q.toml"), b"rules = []")]
    )
    assert v != policy_version([("d", "compliance", settings, b"rules = []")])
    assert policy_version([]) != v


def test_adapter_version_covers_backend_and_mapping() -> None:
    up = OpenAIAdapterConfig(base_url="http://a/v1", models=["m"])
    assert adapter_version("up", up) == adapter_version(
        "up", OpenAIAdapterConfig(base_url="http://a/v1", models=["m"])
    )
    assert adapter_version("up", up) != adapter_version(
        "up", OpenAIAdapterConfig(base_url="http://b/v1", models=["m"])
    )
    assert adapter_version("up", up) != adapter_version(
        "up", OpenAIAdapterConfig(base_url="http://a/v1", models=["m"], upstream_model="big")
    )
    assert adapter_version("mock", MockAdapterConfig()) != adapter_version(
        "mock", MockAdapterConfig(default_reply="other")
    )


@pytest.mark.parametrize(
    ("header", "no_cache", "no_store"),
    [
        (None, False, False),
        ("", False, False),
        ("no-cache", True, False),
        ("No-Store", False, True),
        ("max-age=0, no-cache", True, False),
        ("no-store, no-cache", True, True),
        ("no-transform", False, False),
        ('private="x", no-cache="set-cookie"', True, False),
    ],
)
def test_cache_control_directives(header: str | None, no_cache: bool, no_store: bool) -> None:
    d = directives(header)
    assert (d.no_cache, d.no_store) == (no_cache, no_store)


@pytest.mark.parametrize(
    ("temperature", "seed", "expected"),
    [
        (0.0, None, True),
        (None, b"7", True),
        (0.7, b"7", True),
        (None, None, False),
        (0.7, None, False),
        (0.7, b"null", False),
    ],
)
def test_deterministic(temperature: float | None, seed: bytes | None, expected: bool) -> None:
    assert deterministic(temperature, seed) is expected


def test_numbers_of_any_exponent_are_canonical_by_value() -> None:
    from aiserve_trio.cache.key import canonical, canonical_bytes

    assert canonical_bytes(canonical(b"1e1000000")) == canonical_bytes(canonical(b"10e999999"))
    assert canonical_bytes(canonical(b"1e1000000")) != canonical_bytes(canonical(b"1e999999"))
    # A long mantissa is not rounded into another number's key.
    a = b"1." + b"1" * 40
    assert canonical_bytes(canonical(a)) != canonical_bytes(canonical(a + b"1"))
