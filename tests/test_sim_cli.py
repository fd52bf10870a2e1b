"""``aiserve-sim``'s command line as hypercorn gets it (no sockets: the config it builds)."""

from __future__ import annotations

import pytest

from aiserve_trio.sim.cli import build_parser, hypercorn_config


def test_the_listen_backlog_reaches_hypercorn() -> None:
    config = hypercorn_config(build_parser().parse_args(["--backlog", "2048"]))
    assert config.backlog == 2048
    assert config.bind == ["127.0.0.1:8100"]


def test_the_default_backlog_is_a_production_backends_not_hypercorns() -> None:
    # hypercorn's own 100 overflowed in a storm of new upstream connections.
    assert hypercorn_config(build_parser().parse_args([])).backlog == 4096


@pytest.mark.parametrize("bad", ["0", "-5", "many"])
def test_a_backlog_that_is_not_a_positive_number_is_refused(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--backlog", bad])
    assert exited.value.code == 2
    assert f"--backlog: a whole number of at least 1, not '{bad}'" in capsys.readouterr().err


def test_the_help_tells_the_backlog() -> None:
    text = build_parser().format_help()
    assert "--backlog" in text
    assert "default 4096" in text
