"""The README's "Semantic cache" commands, run as written against a real hypercorn
(the example config, the mock's lexical vectors), and its figures against the command."""

from __future__ import annotations

import json
import re

import pytest
from bench import semantic

from .servers import ROOT, hypercorn_gateway
from .test_readme import DOCS, run, sh_block

pytestmark = pytest.mark.slow


def shown_output(after: str) -> str:
    """The plain block right after the ``sh`` block that has ``after``."""
    m = re.search(r"```sh\n[^`]*" + re.escape(after) + r"[^`]*```\n\n```\n(.*?)```", DOCS, re.S)
    assert m is not None
    return m.group(1)


def test_the_semantic_cache_example_answers_as_the_readme_says() -> None:
    commands = sh_block("configs/examples/semantic-cache.toml")
    assert commands[0].startswith("AISERVE_CONFIG=configs/examples/semantic-cache.toml ")
    define, asks = commands[1], commands[2:]
    assert define.startswith("ask() {")
    with hypercorn_gateway(ROOT / "configs/examples/semantic-cache.toml") as (base, _):
        out = "".join(run(f"{define}\n{a}", gateway=base) for a in asks)
    got = out.replace("\r", "").lower()
    assert got == shown_output("configs/examples/semantic-cache.toml")


def test_the_tuning_figures_are_what_the_command_reports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert semantic.main(["--threshold", "0.92", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    p, n = r["paraphrase"], r["near_miss"]
    said = " ".join(DOCS.split())
    assert f"{r['pairs']} labelled pairs" in said
    assert (
        f"no false hit of {n['pairs']} near misses ({n['stopped_by_guard']} stopped by the "
        f"guard, {n['stopped_by_similarity']} by the similarity), and {p['hits']} of "
        f"{p['pairs']} paraphrases hit" in said
    )
