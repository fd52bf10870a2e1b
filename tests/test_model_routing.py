"""Model routing on one route (``adapters = [...]``): the request's model picks the
adapter, a model two adapters claim is refused at load naming the key, an unserved
model is a 404 listing what the route serves, a group is an adapter like any other,
``/v1/models`` names who owns each model, reload and the console pick up a changed list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from aiserve_trio.adapters.base import Adapter, Delta, DeltaSink, InferenceRequest, Usage
from aiserve_trio.adapters.retry import Progress, RetryPolicy
from aiserve_trio.config import ConfigError, parse_config
from aiserve_trio.core.errors import UpstreamStatusError
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .fakes import RecordingHook
from .test_reload import reload_now, running, write

OFF = "[auth]\nenabled = false\n"


def mock(name: str, models: str, reply: str) -> str:
    return f"""
[adapters.{name}]
kind = "mock"
models = {models}
ttft_ms = 5
inter_token_ms = 1
default_reply = "{reply}"
"""


def conf(adapters: str = '["one", "two"]', *, extra: str = "", route: str = "") -> str:
    return f"""
{OFF}
{mock("one", '["m-one", "m-shared-one"]', "from one")}
{mock("two", '["m-two"]', "from two")}
{mock("three", '["m-three", "m-two"]', "from three")}
{extra}
[[routes]]
path = "/v1/chat/completions"
name = "chat"
adapters = {adapters}
{route}
"""


def body(model: str | None, text: str = "hi", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": [{"role": "user", "content": text}], **extra}
    if model is not None:
        out["model"] = model
    return out


async def ask(app: App, model: str | None, **extra: Any) -> tuple[int, dict[str, Any]]:
    r = await Client(app).request("POST", "/v1/chat/completions", json_body=body(model, **extra))
    return r.status, r.json()


async def test_the_model_picks_the_adapter(autojump_clock: Any) -> None:
    app = App(parse_config(conf()))
    for model, reply in (
        ("m-one", "from one"),
        ("m-two", "from two"),
        ("m-shared-one", "from one"),
    ):
        status, out = await ask(app, model)
        assert status == 200, out
        assert out["choices"][0]["message"]["content"] == reply
        assert out["model"] == model


async def test_no_model_goes_to_the_default_adapter(autojump_clock: Any) -> None:
    app = App(parse_config(conf('["two", "one"]')))
    status, out = await ask(app, None)
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == "from two"
    # `adapter` names the default explicitly, and joins the list.
    app = App(parse_config(conf('["two"]', route='adapter = "one"')))
    status, out = await ask(app, None)
    assert (status, out["choices"][0]["message"]["content"]) == (200, "from one")
    status, out = await ask(app, "m-two")
    assert (status, out["choices"][0]["message"]["content"]) == (200, "from two")


async def test_an_unserved_model_is_404_listing_what_the_route_serves(autojump_clock: Any) -> None:
    app = App(parse_config(conf()))
    status, out = await ask(app, "gpt-4o")
    assert status == 404
    err = out["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert "'gpt-4o'" in err["message"]
    for model in ("m-one", "m-shared-one", "m-two"):
        assert model in err["message"]


@pytest.mark.parametrize(
    ("adapters", "route", "key", "why"),
    [
        (
            '["one", "three", "two"]',
            "",
            "routes[0].adapters[2]",
            "'m-two' is served by both 'three' and 'two'",
        ),
        (
            '["two"]',
            'adapter = "three"',
            "routes[0].adapters[0]",
            "'m-two' is served by both 'three' and 'two'",
        ),
        ('["one", "nope"]', "", "routes[0].adapters[1]", "unknown adapter 'nope'"),
        ('["one", "one"]', "", "routes[0].adapters[1]", "'one' is named more than once"),
        (
            '["one"]',
            'kind = "embeddings"',
            "routes[0].adapters",
            "for chat, responses and messages routes",
        ),
        ('["one"]', "cache = {}", "routes[0].cache", "no response cache"),
        ("[]", "", "routes[0].adapter", "missing"),
    ],
)
def test_a_bad_adapters_list_is_refused_at_load_naming_the_key(
    adapters: str, route: str, key: str, why: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(conf(adapters, route=route), source="routing.toml")
    message = str(info.value)
    assert f"routing.toml: key `{key}`" in message
    assert why in message


async def test_models_lists_every_model_with_its_owner(autojump_clock: Any) -> None:
    extra_route = '\n[[routes]]\npath = "/v1/three"\nadapter = "three"\n'
    app = App(parse_config(conf() + extra_route))
    r = await Client(app).request("GET", "/v1/models")
    owners = {m["id"]: m["owned_by"] for m in r.json()["data"]}
    assert owners == {"m-one": "one", "m-shared-one": "one", "m-two": "two", "m-three": "three"}


class Flaky(Adapter):
    """Answers after ``failures`` tries fail with ``status`` (before any token)."""

    def __init__(
        self,
        name: str,
        models: list[str],
        failures: int,
        status: int,
        hook: RecordingHook | None = None,
    ) -> None:
        policy = RetryPolicy(max_retries=2, base=0.01, cap=0.01)
        super().__init__(name, models, policy=policy, hook=hook or RecordingHook())
        self.failures = failures
        self.status = status
        self.tries = 0

    async def attempt(self, request: InferenceRequest, send: DeltaSink, progress: Progress) -> None:
        self.tries += 1
        if self.tries <= self.failures:
            raise UpstreamStatusError(f"{self.name}: {self.status}", upstream_status=self.status)
        await send.send(Delta(text=f"{self.name} answers"))
        await send.send(
            Delta(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1))
        )


async def test_retries_are_the_chosen_adapters_and_counted_under_its_name(
    autojump_clock: Any,
) -> None:
    hook = RecordingHook()
    flaky = Flaky("two", ["m-two"], failures=1, status=429, hook=hook)
    app = App(parse_config(conf()), adapters={"two": flaky})
    status, out = await ask(app, "m-two")
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == "two answers"
    assert flaky.tries == 2
    # The router reports nothing of its own: one retry, two tries, all under "two".
    assert [kind for kind, _ in hook.events] == ["attempt", "attempt failed", "retrying", "attempt"]
    assert hook.adapters == {"two"}


GROUP = """
[adapters.pool]
kind = "group"
models = ["claude-sonnet-4-5"]
deployments = [{ adapter = "direct" }]
fallbacks = ["bedrock"]
ttft_prior_ms = 10
"""


async def test_a_group_is_an_adapter_of_the_list_and_falls_back(autojump_clock: Any) -> None:
    extra = (
        GROUP
        + mock("direct", '["claude-sonnet-4-5"]', "direct")
        + mock("bedrock", '["claude-sonnet-4-5"]', "bedrock")
    )
    cfg = parse_config(conf('["one", "pool"]', extra=extra))
    # Anthropic directly says 529 (overloaded) on every try: the group moves to Bedrock.
    direct = Flaky("direct", ["claude-sonnet-4-5"], failures=99, status=529)
    bedrock = Flaky("bedrock", ["claude-sonnet-4-5"], failures=0, status=0)
    app = App(cfg, adapters={"direct": direct, "bedrock": bedrock})
    r = await Client(app).request(
        "POST", "/v1/chat/completions", json_body=body("claude-sonnet-4-5")
    )
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"]["content"] == "bedrock answers"
    assert r.headers["x-aiserve-deployment"] == "bedrock"
    assert direct.tries >= 1
    status, out = await ask(app, "m-one")
    assert (status, out["choices"][0]["message"]["content"]) == (200, "from one")


async def test_reload_and_the_console_pick_up_a_changed_list(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "gateway.toml"
    write(path, conf('["one"]'))
    async with running(path) as app:
        status, _ = await ask(app, "m-two")
        assert status == 404
        write(path, conf('["one", "two"]'))
        await reload_now(app, autojump_clock)
        status, out = await ask(app, "m-two")
        assert (status, out["choices"][0]["message"]["content"]) == (200, "from two")
        r = await Client(app).request("GET", "/admin/api/routes")
        (route,) = json.loads(r.body)["routes"]
        assert route["adapters"] == ["one", "two"]
        assert route["models"] == {"m-one": "one", "m-shared-one": "one", "m-two": "two"}


async def test_a_messages_route_routes_by_model_too(autojump_clock: Any) -> None:
    # Anthropic's Messages API in (the apis codec), whichever adapter the model names out.
    route = '\n[[routes]]\npath = "/v1/messages"\nname = "messages"\nkind = "messages"\nadapters = ["one", "two"]\n'
    app = App(parse_config(conf() + route))
    for model, reply in (("m-one", "from one"), ("m-two", "from two")):
        body = {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
        r = await Client(app).request("POST", "/v1/messages", json_body=body)
        assert r.status == 200, r.body
        out = r.json()
        assert out["type"] == "message"
        assert out["content"][0]["text"] == reply
