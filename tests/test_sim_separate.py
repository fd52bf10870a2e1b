"""The simulator is a program of its own (issue 45): ``aiserve-sim`` is its entry point,
and the gateway -- its app, the embedded default's mock model answering a request --
never imports ``aiserve_trio.sim``. The package map (``test_architecture``) keeps the
sim from importing the gateway; this keeps the gateway from needing the sim."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

from .test_architecture import ROOT

PROBE = """
import sys, trio
import aiserve_trio
from aiserve_trio.runtime.asgi import App
from aiserve_trio.config import load_config
from tests.asgi_client import Client, chat_body

aiserve_trio.app.get()

async def main():
    app = App(load_config(None))
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            r = await Client(app).chat(chat_body("echo: hello"))
            assert r.status == 200, r.body
            assert r.json()["choices"][0]["message"]["content"] == "hello", r.body
        finally:
            await app.shutdown()

trio.run(main)
print(sorted(m for m in sys.modules if m.startswith("aiserve_trio.sim")))
"""


def test_the_sim_is_its_own_entry_point() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["aiserve-sim"] == "aiserve_trio.sim.cli:main"


def test_the_gateway_answers_with_its_mock_without_importing_the_sim() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AISERVE_CONFIG"}  # the embedded one
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
        cwd=ROOT, check=False, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
