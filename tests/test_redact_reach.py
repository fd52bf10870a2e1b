"""gdpr-redact reaches every field that goes upstream (issue 33, item 7): message
``name``, unknown fields, URLs, top-level ``user`` / ``metadata`` / unknown fields,
object keys and numbers; field by field (pure), then one request carrying personal
data everywhere through a real aiserve-sim, and the recordings."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from aiserve_trio.config import build_policies
from aiserve_trio.core.errors import PolicyViolation
from aiserve_trio.core.messages import Message, decode_message
from aiserve_trio.core.slices import finish
from aiserve_trio.policies.base import PolicyContext
from aiserve_trio.policies.reach import Walker
from aiserve_trio.policies.redact import GdprRedact, build_rules
from aiserve_trio.policies.stream import Rewriter
from aiserve_trio.record.recorder import ThreadDisk
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .conftest import make_config
from .sim_process import run_sim
from .test_record import read_lines, record_config, serving

EMAIL = "jane.doe@example.org"
PHONE = "+86 138 0013 8000"
CARD = "4111 1111 1111 1111"
CARD_NUMBER = 4111111111111111
IBAN = "DE89 3704 0044 0532 0130 00"
CN_ID = "11010519491231002X"
IP = "192.168.1.10"
#: What must not be found anywhere in what leaves (digits as a run, too).
TELLS = (
    "jane.doe",
    "example.org",
    "13800138000",
    "138 0013 8000",
    "4111111111111111",
    "4111 1111",
    "DE89",
    "11010519491231002",
    "192.168.1.10",
)
RW = Rewriter(build_rules())
CTX = PolicyContext(route="r", channel="app", tenant="t", request_id="x")


def gdpr(opaque: str = "pass") -> GdprRedact:
    cfg = make_config(f'[policies.gdpr-redact]\nopaque = "{opaque}"\n')
    policy = build_policies(["gdpr-redact"], cfg)[0]
    assert isinstance(policy, GdprRedact)
    return policy


def leaks(text: str) -> list[str]:
    flat = text.replace("\\u0040", "@")
    return [t for t in TELLS if t in flat]


def message(obj: dict[str, Any]) -> Message:
    return decode_message(msgspec.Raw(json.dumps(obj).encode()), 0)


def upstream_json(messages: list[Message]) -> str:
    return "[" + ",".join(bytes(m.to_raw()).decode() for m in messages) + "]"


# --- field by field (pure) --------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        {"role": "user", "content": "hi", "name": "jane.doe@example.org"},
        {"role": "user", "content": "hi", "x_note": f"call {PHONE}"},
        {"role": "user", "content": "hi", "x_card": CARD_NUMBER},
        {"role": "user", "content": "hi", "x_meta": {EMAIL: "key", "n": [1, CARD_NUMBER]}},
        {"role": "user", "content": [{"type": "text", "text": f"IBAN {IBAN}"}]},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"https://x.test/i.png?owner={EMAIL}"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"https://x.test/u/{CN_ID}/face.png"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "https://x.test/p?tel=%2B8613800138000"}}
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "hi", "x_ip": IP}]},
        {"role": "user", "content": f"http://{IP}/status"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"to": "jane.doe\\u0040example.org"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": f"card {CARD}"},
    ],
)
def test_every_field_of_a_message_is_redacted(obj: dict[str, Any]) -> None:
    assert leaks(json.dumps(obj)), "the case must carry personal data"
    out = gdpr().check_input([message(obj)], CTX)
    sent = upstream_json(out)
    assert leaks(sent) == []
    # Still a message the upstream can read: the same role, valid JSON everywhere.
    got = json.loads(sent)[0]
    assert got["role"] == obj["role"]
    for call in got.get("tool_calls", []):
        json.loads(call["function"]["arguments"])


def test_a_message_without_personal_data_goes_byte_for_byte() -> None:
    raw = b'{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x.test/a.png?w=1"}}],"x":  [1, 2.50]}'
    msg = decode_message(msgspec.Raw(raw), 0)
    (out,) = gdpr().check_input([msg], CTX)
    assert out is msg
    assert bytes(out.to_raw()) == raw


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("user", EMAIL),
        ("metadata", {"customer": f"{EMAIL}", "phone": PHONE}),
        ("metadata", {EMAIL: "as a key"}),
        ("x_extra", {"card": CARD_NUMBER}),
        ("x_extra", [{"iban": IBAN}]),
        (
            "tools",
            [{"type": "function", "function": {"name": "f", "description": f"call {PHONE}"}}],
        ),
    ],
)
def test_every_top_level_field_is_redacted(field: str, value: Any) -> None:
    fields = {field: msgspec.Raw(json.dumps(value).encode())}
    out = finish(gdpr().fields_steps(fields, CTX))
    sent = json.dumps({k: json.loads(bytes(v)) for k, v in out.items()})
    assert leaks(sent) == []


def test_an_integer_too_long_to_read_is_invalid_json_not_a_500() -> None:
    from aiserve_trio.core.errors import BadRequest

    raw = b'{"role":"user","content":"hi","x":' + b"7" * 5000 + b"}"
    with pytest.raises(BadRequest) as info:
        gdpr().check_input([decode_message(msgspec.Raw(raw), 0)], CTX)
    assert (info.value.code, info.value.param) == ("invalid_json", "messages[0]")
    with pytest.raises(BadRequest, match="4300 digits"):
        finish(gdpr().fields_steps({"x": msgspec.Raw(b"7" * 5000)}, CTX))


def test_parameters_are_not_data() -> None:
    fields = {"seed": msgspec.Raw(b"4111111111111111"), "temperature": msgspec.Raw(b"0.5")}
    assert finish(gdpr().fields_steps(fields, CTX)) == fields


def test_opaque_payloads_pass_or_are_refused_by_name() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRiQA", "format": "wav"}}
    msg = message({"role": "user", "content": [audio]})
    assert gdpr("pass").check_input([msg], CTX) == [msg]
    with pytest.raises(PolicyViolation) as info:
        gdpr("refuse").check_input([msg], CTX)
    assert info.value.param == "messages[0].content[0].input_audio.data"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(PolicyViolation, match=r"content\[0\]\.image_url\.url"):
        gdpr("refuse").check_input([message({"role": "user", "content": [image]})], CTX)


_SECRETS = st.sampled_from([EMAIL, PHONE, CARD, IBAN, CN_ID, IP])
_PLAIN = st.text(alphabet="abc xyz.,", max_size=8)


def _planted(secret: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """JSON values with ``secret`` somewhere: a string, a key, a URL query, a number."""
    leaf = st.one_of(
        st.builds(lambda a, s, b: f"{a} {s} {b}", _PLAIN, secret, _PLAIN),
        secret.map(lambda s: f"https://x.test/a?q={s}"),
        st.just(CARD_NUMBER),
        _PLAIN,
        st.integers(-5, 5),
    )
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=3),
            st.dictionaries(st.one_of(_PLAIN, secret), kids, max_size=3),
        ),
        max_leaves=8,
    )


@settings(max_examples=150, deadline=None)
@given(_planted(_SECRETS))
def test_no_planted_secret_survives_anywhere_in_a_structure(value: Any) -> None:
    walker = Walker(lambda text: RW.rewrite_steps(text))
    out = finish(walker.value(value, "v"))
    assert leaks(json.dumps(out)) == []
    if not leaks(json.dumps(value)):
        assert out is value  # nothing to take out: the very same value


# --- through a real upstream (aiserve-sim) -----------------------------------------


@pytest.fixture(scope="module")
def sim_addr() -> Iterator[str]:
    with run_sim() as addr:
        yield addr


EVERYWHERE: dict[str, Any] = {
    "model": "sim-model",
    "user": EMAIL,
    "metadata": {"contact": PHONE},
    "x_profile": {"card": CARD_NUMBER, EMAIL: IP},
    "messages": [
        {"role": "system", "content": f"The customer's IBAN is {IBAN}."},
        {
            "role": "user",
            "name": "jane_doe",
            "x_ref": CN_ID,
            "content": [
                {"type": "text", "text": f"my card is {CARD}"},
                {
                    "type": "image_url",
                    "image_url": {"url": f"https://x.test/{CN_ID}.png?mail={EMAIL}"},
                },
            ],
        },
    ],
}


async def test_personal_data_in_every_field_never_reaches_the_upstream(sim_addr: str) -> None:
    assert len(leaks(json.dumps(EVERYWHERE))) >= 7
    cfg = make_config(
        f'[adapters.sim]\nkind = "openai"\nbase_url = "http://{sim_addr}/v1"\n'
        'models = ["sim-model"]\n\n[[routes]]\npath = "/v1/bank"\nname = "bank"\n'
        'adapter = "sim"\npolicies = ["gdpr-redact"]\n'
    )
    app = App(cfg)
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            r = await Client(app).request("POST", "/v1/bank", json_body=EVERYWHERE)
        finally:
            await app.shutdown()
    assert r.status == 200, r.body
    async with httpx2.AsyncClient() as c:
        seen = (await c.get(f"http://{sim_addr}/sim/requests")).json()["requests"]
    body = seen[-1]["body"]
    assert '"messages"' in body
    assert leaks(body) == []
    sent = json.loads(body)
    assert sent["messages"][1]["content"][1]["image_url"]["url"].startswith("https://x.test/")
    assert sent["user"] == "[EMAIL]"


# --- recordings ---------------------------------------------------------------------


async def test_recordings_keep_no_keys_or_numbers_and_are_the_owners_only(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    old = os.umask(0o022)
    try:
        app = App(record_config(tmp_path / "rec"))
        body = {
            "model": "aiserve-mock",
            "messages": [
                {"role": "user", "content": "hello", "x_card": CARD_NUMBER, "x": {EMAIL: 1}}
            ],
            "user": EMAIL,
            "metadata": {"contact": PHONE},
        }
        async with serving(app) as client:
            assert (await client.chat(body)).status == 200
    finally:
        os.umask(old)
    (line,) = read_lines(tmp_path / "rec")
    assert leaks(json.dumps(line)) == []
    files = list((tmp_path / "rec").glob("rec-*.jsonl"))
    assert [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o600]
    assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700


async def test_a_recording_file_made_loose_is_tightened(tmp_path: Path) -> None:
    (tmp_path / "rec-1.jsonl").write_text("")
    (tmp_path / "rec-1.jsonl").chmod(0o644)
    disk = ThreadDisk(tmp_path)
    await disk.open("rec-1.jsonl")
    await disk.close()
    assert stat.S_IMODE((tmp_path / "rec-1.jsonl").stat().st_mode) == 0o600


async def test_a_responses_request_is_redacted_in_every_field(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiserve_trio.adapters.base import DeltaSink, InferenceRequest
    from aiserve_trio.adapters.retry import Progress

    route = (
        '\n[[routes]]\npath = "/v1/r"\nkind = "responses"\nadapter = "mock"\n'
        'default_model = "aiserve-mock"\npolicies = ["gdpr-redact"]\n'
    )
    app = App(make_config(route))
    adapter = app.routes["/v1/r"].adapter
    inner = adapter.attempt
    sent: list[InferenceRequest] = []

    async def spy(request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        sent.append(request)
        await inner(request, send, progress)

    monkeypatch.setattr(adapter, "attempt", spy)
    body = {
        "model": "aiserve-mock",
        "input": f"mail {EMAIL}",
        "instructions": f"the customer's phone is {PHONE}",
        "user": EMAIL,
        "metadata": {"card": CARD},
    }
    r = await Client(app).request("POST", "/v1/r", json_body=body)
    assert r.status == 200, r.body
    (request,) = sent
    upstream = upstream_json(request.messages) + json.dumps(
        {k: json.loads(bytes(v)) for k, v in request.extra.items()}
    )
    assert leaks(upstream) == []
    assert "[EMAIL]" in upstream
