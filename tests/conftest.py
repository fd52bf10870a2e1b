from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aiserve_trio import server
from aiserve_trio.adapters import tokens
from aiserve_trio.config import Config, default_config_text, parse_config
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client
from .redis_cluster import redis_cluster, redis_sentinel  # noqa: F401 - shared session fixtures
from .redis_server import redis_server, redis_up  # noqa: F401 - shared session fixtures
from .servers import hypercorn_gateway

#: The embedded default with a faster mock, so that tests stream in a few virtual ms.
FAST = {"ttft_ms": "10", "inter_token_ms": "5"}


def config_text(**mock: str) -> str:
    """The embedded default TOML with mock pacing replaced."""
    text = default_config_text()
    for key, value in {**FAST, **mock}.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
    return text


def make_config(extra: str = "", **mock: str) -> Config:
    """The default config (fast mock), with ``extra`` TOML appended."""
    return parse_config(config_text(**mock) + "\n" + extra, source="<test>")


@pytest.fixture(autouse=True, scope="session")
def _tokenizer_loaded() -> None:
    """The mock's models' tokenizer table, loaded once. A reply that ends without the
    backend's usage (a client that left, a cap, a drop) is billed for its prompt as
    the gateway counts it (``stages/billing.py``), and the table's first load runs in a
    thread, which a test's virtual clock (``autojump_clock``) sees as time passing."""
    tokens._loaded["cl100k_base"] = tokens.get_encoding("cl100k_base")


@pytest.fixture(autouse=True)
def _hypercorn_as_shipped() -> Iterator[None]:
    """Each test starts and ends with hypercorn as shipped (an app's start-up installs the
    seam: taken out again here, so no test runs on a seam it did not ask for)."""
    server.uninstall()
    yield
    server.uninstall()


def seam_on() -> None:
    """Install the hypercorn seam for this test, whatever ``AISERVE_HYPERCORN_PATCHES`` says
    (tests of the seam itself; the autouse fixture above takes it out again)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(server.SWITCH, raising=False)
        server.install()
    assert server.installed()


@pytest.fixture
def make_app() -> Callable[..., App]:
    def build(extra: str = "", *, config: Config | None = None, **kwargs: Any) -> App:
        cfg = config if config is not None else make_config(extra)
        return App(cfg, **kwargs)

    return build


@pytest.fixture
def app(make_app: Callable[..., App]) -> App:
    return make_app()


@pytest.fixture
def client(app: App) -> Client:
    return Client(app)


@pytest.fixture(scope="session")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default config with a fast mock, as a file for real servers."""
    path = tmp_path_factory.mktemp("cfg") / "gateway.toml"
    path.write_text(config_text(ttft_ms="5", inter_token_ms="2"))
    return path


@pytest.fixture(scope="session")
def gateway(config_file: Path) -> Iterator[str]:
    """The gateway under the real hypercorn binary, shared by the real-client tests."""
    with hypercorn_gateway(config_file) as (base, _):
        yield base
