"""With a Redis session bus, a key change reaches the other workers through Redis in about
0.1 s, not at the next database poll (issue 47, item 2): two apps on one audit file and
one Redis, their database polls set to 30 s so that only the Redis signal can tell."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from aiserve_trio.config import parse_config
from aiserve_trio.runtime.asgi import App

from .authcfg import OFF
from .conftest import config_text
from .keyscfg import KEY_ADMIN, chat, create, h, keys_toml
from .redis_server import RedisServer
from .sim_gateway import running

pytestmark = pytest.mark.slow

#: The signal's stated bound (0.1 s a read), with a loaded machine's margin.
BOUND_S = 0.6


def app(tmp: Path, redis: str) -> App:
    text = config_text().replace(OFF, keys_toml(tmp))
    sessions = f'[sessions]\nbackend = "redis"\nurl = "{redis}"\nkey_prefix = "keystest"\n'
    assert '[sessions]\nbackend = "memory"\n' in text
    text = text.replace('[sessions]\nbackend = "memory"\n', sessions, 1)
    built = App(parse_config(text, source="<test>"))
    assert built.gateway.keys is not None
    built.gateway.keys.poll_s = 30.0  # only the Redis signal can bring a change in time
    return built


async def test_a_change_reaches_the_other_worker_through_redis(
    tmp_path: Path, redis_up: RedisServer
) -> None:
    one, two = app(tmp_path, redis_up.url), app(tmp_path, redis_up.url)
    async with running(one) as a, running(two) as b:
        await trio.sleep(0.3)  # both have read the signal's value once
        made = (await create(a)).json()
        start = time.monotonic()
        while (await chat(b, made["key"])).status != 200:
            assert time.monotonic() - start < BOUND_S, "no signal reached the other worker"
            await trio.sleep(0.02)
        r = await b.request("POST", f"/admin/keys/{made['id']}/revoke", headers=h(KEY_ADMIN))
        assert r.status == 200
        start = time.monotonic()
        while (await chat(a, made["key"])).status != 401:
            assert time.monotonic() - start < BOUND_S, "the revocation did not reach it"
            await trio.sleep(0.02)
