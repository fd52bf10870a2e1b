"""Messages keep what the client sent; the upstream body is the client's with documented changes."""

from __future__ import annotations

import json

import msgspec
import pytest

from aiserve_trio.adapters.base import InferenceRequest
from aiserve_trio.adapters.wire import chat_body
from aiserve_trio.core.errors import BadRequest
from aiserve_trio.core.messages import Message, decode_message, map_json_strings


def raw(obj: object, *, text: str | None = None) -> msgspec.Raw:
    return msgspec.Raw((text or json.dumps(obj)).encode())


def upper_digits(text: str) -> str:
    return "".join("#" if c.isdigit() else c for c in text)


def test_an_untouched_message_goes_up_byte_for_byte_with_unknown_fields() -> None:
    sent = '{ "role" : "user", "content": "hi",  "x_vendor": {"a": [1, 2.50]} }'
    m = decode_message(raw(None, text=sent), 0)
    assert m.map_text(lambda t: t) is m
    assert bytes(m.to_raw()) == sent.encode()


def test_a_rewritten_message_patches_only_what_changed() -> None:
    sent = {
        "role": "user",
        "name": "ann",
        "x_vendor": {"keep": "me 123"},
        "content": [
            {"type": "text", "text": "card 4111", "cache_control": {"type": "ephemeral"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
        ],
    }
    m = decode_message(raw(sent), 3).map_text(upper_digits)
    out = json.loads(bytes(m.to_raw()))
    assert out["x_vendor"] == {"keep": "me 123"}  # not text the gateway owns
    assert out["name"] == "ann"
    assert out["content"][0] == {
        "type": "text",
        "text": "card ####",
        "cache_control": {"type": "ephemeral"},
    }
    assert out["content"][1] == sent["content"][1]  # type: ignore[index]
    assert m.text() == "card ####"


def test_tool_call_arguments_stay_json_and_only_string_values_change() -> None:
    sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "pay", "arguments": '{"card": "4111", "n": 12, "k2": ["7"]}'},
            }
        ],
    }
    m = decode_message(raw(sent), 1).map_text(upper_digits)
    call = json.loads(bytes(m.to_raw()))["tool_calls"][0]
    assert call["id"] == "call_1"
    assert json.loads(call["function"]["arguments"]) == {"card": "####", "n": 12, "k2": ["#"]}


def test_arguments_that_are_not_json_are_still_rewritten() -> None:
    assert map_json_strings('{"a": "12" broken', upper_digits) == '{"a": "##" broken'
    assert map_json_strings('{"a": 12}', upper_digits) == '{"a": 12}'


@pytest.mark.parametrize(
    ("sent", "param", "code"),
    [
        ({"role": 1, "content": "x"}, "messages[2].role", "invalid_type"),
        ({"role": "robot", "content": "x"}, "messages[2].role", "invalid_type"),
        ({"role": "user", "content": [{"text": "no type"}]}, "messages[2].content[0].type", "missing_required_parameter"),
        ({"role": "user", "content": 5}, "messages[2].content", "invalid_type"),
        ({"content": "x"}, "messages[2].role", "missing_required_parameter"),
    ],
)
def test_a_malformed_message_is_a_400_naming_it(sent: object, param: str, code: str) -> None:
    with pytest.raises(BadRequest) as info:
        decode_message(raw(sent), 2)
    assert info.value.param == param
    assert info.value.code == code


def request(**extra: str) -> InferenceRequest:
    return InferenceRequest(
        request_id="r",
        model="m",
        messages=[decode_message(raw({"role": "user", "content": "hi"}), 0)],
        deadline=1.0,
        extra={k: msgspec.Raw(v.encode()) for k, v in extra.items()},
    )


def test_the_upstream_body_is_the_clients_with_the_documented_changes() -> None:
    r = request(
        temperature="0.70",
        tools='[{"type":"function","function":{"name":"f","parameters":{}}}]',
        x_future_field='{"z": [true]}',
        stream_options='{"include_usage": false, "include_obfuscation": true}',
    )
    body = chat_body(r, "upstream-model")
    text = body.decode()
    assert '"temperature":0.70' in text  # the client's bytes, not a re-encoded float
    assert '"x_future_field":{"z": [true]}' in text
    out = json.loads(body)
    assert list(out)[:2] == ["model", "messages"]
    assert out["model"] == "upstream-model"
    assert out["stream"] is True
    assert out["stream_options"] == {"include_usage": True, "include_obfuscation": True}
    assert "max_tokens" not in out


def test_the_gateways_token_limit_goes_up_under_the_clients_key() -> None:
    r = msgspec.structs.replace(request(max_completion_tokens="500"), max_tokens=100)
    out = json.loads(chat_body(r, "m"))
    assert out["max_completion_tokens"] == 100
    assert "max_tokens" not in out
    same = msgspec.structs.replace(request(max_tokens="100"), max_tokens=100)
    assert '"max_tokens":100' in chat_body(same, "m").decode()
    none_sent = msgspec.structs.replace(request(), max_tokens=64)
    assert json.loads(chat_body(none_sent, "m"))["max_tokens"] == 64


def test_a_message_the_gateway_made_encodes_its_fields() -> None:
    m = Message(role="system", content="facts")
    assert json.loads(bytes(m.to_raw())) == {"role": "system", "content": "facts"}
