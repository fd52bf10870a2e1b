"""A cold-start storm, driven through the gateway: the baseline's storm detector fed by the
cache's real hit rate and the route's P99, the gauge on /metrics, and the shipped alert
firing on what was scraped (promtool)."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import partial
from pathlib import Path

import pytest
import trio

from .asgi_client import Client
from .cachefakes import CountingModel, ask, cache_app

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "configs/prometheus/aiserve-rules.yml"
WINDOW = 60


def _gauges(text: str, name: str) -> dict[str, float]:
    """``name``'s samples on a /metrics page, by route."""
    out = {}
    for m in re.finditer(rf'^{name}\{{route="([a-z_0-9]+)"\}} (\S+)$', text, re.M):
        out[m[1]] = float(m[2])
    return out


async def _storm(autojump_clock: trio.testing.MockClock) -> list[str]:
    """Two baseline windows of the chat route: warm, then a storm. The /metrics pages
    scraped after each window closed."""
    model = CountingModel(ttft=0.1, gap=0.01)
    app, _ = cache_app(
        "{}",
        f"\n[observability]\nbaseline_window_s = {WINDOW}\nbaseline_min_requests = 5\n",
        model=model,
    )
    client = Client(app)
    pages = []
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        t0 = trio.current_time()
        # Window 1: one question, asked again and again: 1 miss, 19 hits.
        for _ in range(20):
            r = await client.chat(ask("what are your opening hours"))
            assert r.status == 200
            await trio.sleep(2)
        await trio.sleep_until(t0 + WINDOW + 1)
        pages.append(app.metrics.render().decode())
        # Window 2: a client library starts sending a slightly different top_p each
        # time -- every request a new key -- and the model, asked for all of them,
        # slows down: the cold-start storm.
        model.ttft = 1.0
        for i in range(20):
            body = ask("what are your opening hours", seed=1, top_p=0.9 + i / 1000)
            assert (await client.chat(body)).headers["x-aiserve-cache"] == "miss"
        await trio.sleep_until(t0 + 2 * WINDOW + 1)
        pages.append(app.metrics.render().decode())
        nursery.cancel_scope.cancel()
    await app.shutdown()
    return pages


async def test_a_key_that_starts_missing_raises_the_storm_gauge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    warm, storm = await _storm(autojump_clock)
    assert _gauges(warm, "aiserve_cache_storm") == {"chat": 0.0}
    assert _gauges(storm, "aiserve_cache_storm") == {"chat": 1.0}
    assert _gauges(storm, "aiserve_cache_hit_ratio_change") == {"chat": -1.0}
    assert _gauges(storm, "aiserve_p99_change")["chat"] > 3.0


@pytest.mark.slow
async def test_the_scraped_storm_fires_the_shipped_alert(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool (Debian package prometheus) must be installed"
    pages = await _storm(autojump_clock)
    values = " ".join(str(int(_gauges(p, "aiserve_cache_storm")["chat"])) for p in pages)
    assert values == "0 1"
    test = tmp_path / "storm.test.yml"
    test.write_text(
        f"""rule_files: ["{RULES}"]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'aiserve_cache_storm{{job="aiserve", instance="gw:8000", route="chat"}}'
        values: '{values}'
    alert_rule_test:
      - alertname: AiserveCacheColdStartStorm
        eval_time: 0m
        exp_alerts: []
      - alertname: AiserveCacheColdStartStorm
        eval_time: 1m
        exp_alerts:
          - exp_labels: {{severity: critical, job: aiserve, instance: "gw:8000", route: chat}}
            exp_annotations:
              summary: "Cache hit ratio fell >15 % while P99 rose >300 % on chat"
              description: "A cold-start storm: warm the cache or shed load."
"""
    )
    # In a thread with a real timeout: the virtual clock would jump over any wait here.
    cmd = [promtool, "test", "rules", str(test)]
    run = partial(subprocess.run, cmd, capture_output=True, text=True, timeout=60, check=False)
    out = await trio.to_thread.run_sync(run)
    assert out.returncode == 0, out.stdout + out.stderr
