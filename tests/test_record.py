"""The recorder: what a line holds (body after policies, redaction, headers, labels, outcome),
what it never holds, a full buffer, disk errors, rotation, shutdown."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from aiserve_trio.config import Config, parse_config
from aiserve_trio.record.line import hash_session
from aiserve_trio.record.recorder import Chunk, RecFile, Rotation, ThreadDisk, expired
from aiserve_trio.record.schema import decoder
from aiserve_trio.runtime.asgi import App

from .asgi_client import Client, chat_body
from .authcfg import KEY_A, auth_toml
from .conftest import config_text, make_config
from .test_record_labels import TABLE

PII = "mail bob.smith@example.com or call +86 138 0013 8000, card 4111 1111 1111 1111"


def record_config(path: Path, record: str = "", extra: str = "") -> Config:
    return make_config(f'[record]\nenabled = true\npath = "{path}"\n{record}\n{extra}')


@asynccontextmanager
async def serving(app: App, *, as_lifespan: bool = False) -> AsyncIterator[Client]:
    """The app started, then shut down.

    ``as_lifespan``: cancel the lifetime nursery after shutdown() as the lifespan
    does, so what the recorder has not written by then is lost. Only with a fake
    disk: on the virtual clock, shutdown's grace would pass while a real disk
    thread runs.
    """
    async with trio.open_nursery() as nursery:
        await app.startup(nursery)
        try:
            yield Client(app)
        finally:
            await app.shutdown()
            if as_lifespan:
                nursery.cancel_scope.cancel()


def recording_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("rec-*.jsonl"))


def raw_text(directory: Path) -> str:
    return "".join(f.read_text() for f in recording_files(directory))


def read_lines(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw_text(directory).splitlines()]


def sample(app: App, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


async def record(tmp_path: Path, *bodies: dict[str, Any], record: str = "", extra: str = "", headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    app = App(record_config(tmp_path, record, extra))
    async with serving(app) as client:
        for b in bodies:
            r = await client.chat(b, headers=headers)
            assert r.status == 200, r.body
    return read_lines(tmp_path)


# --- what a line holds -----------------------------------------------------------


async def test_recorded_lines_carry_the_labels_the_rules_say(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    lines = await record(tmp_path, *(b for _, b, _ in TABLE if "messages" in b))
    expected = [labels for _, b, labels in TABLE if "messages" in b]
    assert [line["labels"] for line in lines] == expected
    # What aiserve-replay reads back.
    records = [decoder.decode(x) for x in raw_text(tmp_path).splitlines()]
    assert [r.labels for r in records] == expected
    assert all(r.has_body for r in records)


async def test_a_line_holds_route_body_headers_and_outcome(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    body = chat_body("hello", stream=True, temperature=0.5, user="u-1")
    headers = {"x-channel": "app", "x-session-id": "s-42", "x-request-timeout-ms": "9000"}
    (line,) = await record(tmp_path, body, headers=headers)
    assert line["v"] == 2  # schema version 2: a line may be an MCP tool call
    assert line["route"] == "/v1/chat/completions"
    assert line["body"] == {
        "model": "aiserve-mock",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "temperature": 0.5,
        "user": "u-1",
    }
    hashed = line["headers"].pop("x-session-id")
    assert line["headers"] == {"x-channel": "app", "x-request-timeout-ms": "9000"}
    assert len(hashed) == 32
    assert hashed != "s-42"
    out = line["outcome"]
    assert out["status"] == "ok"
    assert out["model"] == "aiserve-mock"  # the model that answered
    assert out["finish_reason"] == "stop"
    assert 0 < out["ttft_ms"] < out["total_ms"]
    assert out["prompt_tokens"] > 0
    assert out["completion_tokens"] > 0
    assert set(out["stages_ms"]) == {"parse", "context", "inference", "sse"}
    assert 0 <= line["offset"] < 60
    assert abs(line["started"] - time.time()) < 600


async def test_session_ids_are_hashed_with_the_configured_key(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AISERVE_RECORD_KEY", "test-key")
    h = {"x-session-id": "customer-13800138000"}
    lines = await record(tmp_path, chat_body("a"), chat_body("b"), headers=h)
    hashed = {line["headers"]["x-session-id"] for line in lines}
    assert hashed == {hash_session(b"test-key", "customer-13800138000")}
    assert "13800138000" not in raw_text(tmp_path)


async def test_the_body_is_the_one_after_the_input_policies(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    # The route's own gdpr-redact rewrote the messages: the recording holds its tokens.
    route = '\n[[routes]]\npath = "/v1/redacted"\nadapter = "mock"\npolicies = ["gdpr-redact"]\n'
    app = App(record_config(tmp_path, "", route))
    async with serving(app) as client:
        r = await client.request("POST", "/v1/redacted", json_body=chat_body(PII))
        assert r.status == 200
    (line,) = read_lines(tmp_path)
    text = line["body"]["messages"][0]["content"]
    assert text == "mail [EMAIL] or call [PHONE], card [CARD]"
    assert "bob.smith" not in raw_text(tmp_path)
    assert "4111" not in raw_text(tmp_path)


async def test_without_a_route_policy_the_default_detectors_redact(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    body = chat_body(PII, metadata={"contact": "bob.smith@example.com"}, user="bob.smith@example.com")
    (line,) = await record(tmp_path, body)
    assert line["body"]["messages"][0]["content"] == "mail [EMAIL] or call [PHONE], card [CARD]"
    # Fields no route policy looks at go through the same detectors.
    assert line["body"]["metadata"] == {"contact": "[EMAIL]"}
    assert line["body"]["user"] == "[EMAIL]"


async def test_redact_false_keeps_what_the_route_let_through(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    (line,) = await record(tmp_path, chat_body(PII), record="redact = false")
    assert line["body"]["messages"][0]["content"] == PII


async def test_session_context_the_gateway_added_is_not_recorded(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    app = App(record_config(tmp_path))
    h = {"x-session-id": "s1"}
    async with serving(app) as client:
        await client.chat(chat_body("first", metadata={"monthly_income": "9000"}), headers=h)
        await client.chat(chat_body("second"), headers=h)
    _, second = read_lines(tmp_path)
    # The second request's prompt had the first turn and the variables in front.
    assert second["body"]["messages"] == [{"role": "user", "content": "second"}]


async def test_authorization_and_cookies_are_never_written(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    auth = auth_toml()
    text = config_text().replace("[auth]\nenabled = false\n", auth)
    cfg_text = text + f'\n[record]\nenabled = true\npath = "{tmp_path}"\n'
    app = App(parse_config(cfg_text, source="<test>"))
    headers = {
        "authorization": f"Bearer {KEY_A}",
        "cookie": "session=cookie-secret-value",
        "x-api-key": "other-secret",
        "x-channel": "app",
    }
    async with serving(app) as client:
        # Verify the key once first: scrypt runs in a thread, and meanwhile the virtual
        # clock jumps from timer to timer of the app's background tasks.
        warm = await client.request("GET", "/v1/models", headers={"authorization": f"Bearer {KEY_A}"})
        assert warm.status == 200
        r = await client.chat(chat_body("hi"), headers=headers)
        assert r.status == 200
        refused = await client.chat(chat_body("hi"), headers={**headers, "authorization": "Bearer aik_alice_" + "z" * 32})
        assert refused.status == 401
    raw = raw_text(tmp_path)
    (line,) = read_lines(tmp_path)
    assert set(line["headers"]) == {"x-channel"}
    for secret in (KEY_A, "aik_alice", "Bearer", "cookie-secret-value", "other-secret", "authorization"):
        assert secret not in raw


async def test_requests_that_never_got_a_body_are_recorded_without_one(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    app = App(record_config(tmp_path))
    async with serving(app) as client:
        bad = await client.chat({"model": "aiserve-mock", "messages": "nope"})
        assert bad.status == 400
    (line,) = read_lines(tmp_path)
    assert line["body"] is None
    assert line["labels"] == {}
    assert line["outcome"]["status"] == "bad_request"
    assert not decoder.decode(raw_text(tmp_path)).has_body


async def test_only_the_routes_asked_for_are_recorded_and_sample_zero_records_none(
    tmp_path: Path, autojump_clock: trio.testing.MockClock,
) -> None:
    second = '\n[[routes]]\npath = "/v1/other"\nadapter = "mock"\n'
    app = App(record_config(tmp_path, 'routes = ["/v1/other"]', second))
    async with serving(app) as client:
        await client.chat(chat_body("not recorded"))
        await client.request("POST", "/v1/other", json_body=chat_body("recorded"))
    assert [line["route"] for line in read_lines(tmp_path)] == ["/v1/other"]
    assert sample(app, "aiserve_record_dropped_total", reason="unrecordable") == 0

    none = tmp_path / "none"
    app = App(record_config(none, "sample = 0.0"))
    async with serving(app) as client:
        for _ in range(5):
            await client.chat(chat_body("x"))
    assert read_lines(none) == []
    assert sample(app, "aiserve_records_written_total") == 0


async def test_a_replays_requests_are_left_out_and_counted_unless_asked_for(
    tmp_path: Path, autojump_clock: trio.testing.MockClock,
) -> None:
    replayed = {"x-aiserve-replay": "3f2a"}
    app = App(record_config(tmp_path))
    async with serving(app) as client:
        await client.chat(chat_body("a client"))
        await client.chat(chat_body("the replay"), headers=replayed)
    assert [line["body"]["messages"][0]["content"] for line in read_lines(tmp_path)] == ["a client"]
    assert sample(app, "aiserve_record_dropped_total", reason="replay") == 1

    kept = tmp_path / "kept"
    app = App(record_config(kept, "include_replays = true"))
    async with serving(app) as client:
        await client.chat(chat_body("the replay"), headers=replayed)
    assert len(read_lines(kept)) == 1
    assert sample(app, "aiserve_record_dropped_total", reason="replay") == 0


async def test_recording_is_off_by_default(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    app = App(make_config())
    assert app.recorder is None
    assert app.observer.recorder is None


# --- off the request path: a slow disk drops, never slows ---------------------------


class SlowDisk:
    """A disk whose writes wait until the test releases them."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.files: dict[str, bytes] = {}
        self.current: str | None = None
        self.writing = False
        self.closed: list[str] = []

    async def prepare(self) -> None:
        pass

    async def open(self, name: str) -> None:
        await self.close()
        self.current = name
        self.files[name] = b""

    async def write(self, data: bytes) -> None:
        self.writing = True
        await self.release.wait()
        assert self.current is not None
        self.files[self.current] += data

    async def close(self) -> None:
        if self.current is not None:
            self.closed.append(self.current)
        self.current = None

    async def listing(self) -> list[RecFile]:
        return []

    async def remove(self, names: Sequence[str]) -> None:
        pass


async def test_a_full_buffer_drops_and_counts_and_requests_do_not_wait(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    app = App(record_config(tmp_path, "buffer = 2"))
    assert app.recorder is not None
    disk = app.recorder.disk = SlowDisk()
    async with serving(app) as client:
        await client.chat(chat_body("one"))
        await trio.testing.wait_all_tasks_blocked()
        assert disk.writing  # the writer holds the first record, stuck on the disk
        took = []
        for i in range(5):
            t0 = trio.current_time()
            r = await client.chat(chat_body(f"more {i}"))
            assert r.status == 200
            took.append(trio.current_time() - t0)
        # Two fit in the buffer, three are dropped; not one request waited for the disk.
        assert sample(app, "aiserve_record_dropped_total", reason="buffer_full") == 3
        assert sample(app, "aiserve_records_written_total") == 0
        assert max(took) < 1.0
        disk.release.set()
    assert sample(app, "aiserve_records_written_total") == 3
    lines = [json.loads(x) for data in disk.files.values() for x in data.splitlines()]
    assert [line["body"]["messages"][0]["content"] for line in lines] == ["one", "more 0", "more 1"]


class FailingDisk(SlowDisk):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.release.set()
        self.failures = failures

    async def write(self, data: bytes) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        await super().write(data)


async def test_a_disk_error_drops_the_batch_counts_it_and_recording_goes_on(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    app = App(record_config(tmp_path))
    assert app.recorder is not None
    disk = app.recorder.disk = FailingDisk(failures=1)
    async with serving(app) as client:
        await client.chat(chat_body("lost"))
        await trio.testing.wait_all_tasks_blocked()
        await client.chat(chat_body("kept"))
        await trio.testing.wait_all_tasks_blocked()
        assert (await client.request("GET", "/healthz")).status == 200
    assert sample(app, "aiserve_record_dropped_total", reason="disk_error") == 1
    assert sample(app, "aiserve_records_written_total") == 1
    # The failed file was given up; the next record started a new one.
    assert len(disk.files) == 2
    assert b"kept" in disk.files[max(disk.files)]


class PacedDisk(SlowDisk):
    """Each write takes a while, as a real one does."""

    def __init__(self) -> None:
        super().__init__()
        self.release.set()

    async def write(self, data: bytes) -> None:
        await trio.sleep(0.05)
        await super().write(data)


async def test_shutdown_writes_what_is_queued(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    app = App(record_config(tmp_path))
    assert app.recorder is not None
    disk = app.recorder.disk = PacedDisk()
    async with serving(app, as_lifespan=True) as client, trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(client.chat, chat_body(f"q{i}"))
    # Whatever was still queued when shutdown began was written before the lifespan ended.
    assert sum(data.count(b"\n") for data in disk.files.values()) == 20
    assert sample(app, "aiserve_records_written_total") == 20
    assert disk.current is None  # and the file was closed


# --- retention: keep_bytes, keep_s -------------------------------------------------------


def test_retention_deletes_the_oldest_closed_files_first_never_the_open_one() -> None:
    files = [
        RecFile("rec-a-00001.jsonl", 400, 1_000.0),
        RecFile("rec-b-00001.jsonl", 400, 5_000.0),
        RecFile("rec-a-00002.jsonl", 400, 2_000.0),
        RecFile("rec-a-00003.jsonl", 400, 9_950.0),  # written 50 s ago: maybe open
        RecFile("rec-b-00002.jsonl", 400, 9_000.0),  # this writer's open file
    ]
    def gone(**kw: Any) -> list[tuple[str, str]]:
        args: dict[str, Any] = dict(keep_bytes=0, keep_s=0.0, now=10_000.0,
                                    open_name="rec-b-00002.jsonl", busy_s=120.0)
        return [(f.name, why) for f, why in expired(files, **(args | kw))]

    assert gone() == []  # both bounds off
    assert gone(keep_bytes=1_200) == [  # 2,000 bytes: the oldest two go
        ("rec-a-00001.jsonl", "keep_bytes"), ("rec-a-00002.jsonl", "keep_bytes")]
    assert gone(keep_s=6_000.0) == [  # last written more than 6,000 s ago
        ("rec-a-00001.jsonl", "keep_s"), ("rec-a-00002.jsonl", "keep_s")]
    # However small the bound: never the open file, nor one written within busy_s.
    assert [n for n, _ in gone(keep_bytes=1, keep_s=1.0)] == [
        "rec-a-00001.jsonl", "rec-a-00002.jsonl", "rec-b-00001.jsonl"]


class MemoryDisk(SlowDisk):
    """Files in memory, each with the (virtual) wall time of its last write."""

    def __init__(self, wall: Callable[[], float], old: dict[str, float]) -> None:
        super().__init__()
        self.release.set()
        self.wall = wall
        self.mtimes = dict(old)
        self.files.update(dict.fromkeys(old, b"x" * 500))
        self.removed: list[str] = []

    async def open(self, name: str) -> None:
        await super().open(name)
        self.mtimes[name] = self.wall()

    async def write(self, data: bytes) -> None:
        await super().write(data)
        assert self.current is not None
        self.mtimes[self.current] = self.wall()

    async def listing(self) -> list[RecFile]:
        return [RecFile(n, len(b), self.mtimes[n]) for n, b in self.files.items()]

    async def remove(self, names: Sequence[str]) -> None:
        for name in names:
            assert name != self.current, "deleted the open file"
            del self.files[name]
            self.removed.append(name)


async def test_recordings_past_keep_bytes_and_keep_s_are_deleted_oldest_first(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Issue 55 (disk bounded): rotation opened new files, nothing deleted old ones.
    app = App(record_config(tmp_path, "rotate_s = 60\nkeep_bytes = 3000\nkeep_s = 1800"))
    rec = app.recorder
    assert rec is not None
    base = 1_800_000_000.0
    rec.wall = lambda: base + trio.current_time()
    # A file a past run left, ten days old: the pass at start deletes it.
    stale = "rec-20260101T000000Z-1-00001.jsonl"
    disk = rec.disk = MemoryDisk(rec.wall, {stale: base - 10 * 86_400})
    async with serving(app) as client:
        await trio.testing.wait_all_tasks_blocked()
        assert disk.removed == [stale]
        for i in range(12):  # a file each (rotate_s = 60), 100 s apart
            await client.chat(chat_body(f"request {i} " + "x" * 400))
            await trio.sleep(100)
        ours = sorted(n for n in disk.mtimes if n != stale)
        assert len(ours) == 12
        size = {n: len(disk.files.get(n, b"")) for n in ours}
        assert all(600 < b < 3000 for b in size.values() if b)
        gone = [n for n in disk.removed if n != stale]
        kept = sorted(disk.files)
        assert gone == ours[: len(gone)]  # the oldest first, in order
        assert kept == ours[len(gone):]
        # Within keep_bytes, but for the files written in the last rotate_s + 60 s.
        recent = [n for n in kept if rec.wall() - disk.mtimes[n] < 120]
        assert sum(len(disk.files[n]) for n in kept if n not in recent) <= 3000
        assert sum(len(disk.files[n]) for n in kept) > 3000 - max(size.values())
        assert sample(app, "aiserve_record_files_deleted_total", reason="keep_s") == 1
        assert sample(app, "aiserve_record_files_deleted_total", reason="keep_bytes") == len(gone)
        # No traffic for keep_s: the last files go at a pass (every 300 s).
        await trio.sleep(1800 + 120 + 300)
        assert disk.files == {}
        assert sample(app, "aiserve_record_directory_bytes") == 0


async def test_the_real_disk_lists_and_deletes_only_recording_files(tmp_path: Path) -> None:
    disk = ThreadDisk(tmp_path)
    (tmp_path / "rec-x-1-00001.jsonl").write_bytes(b"a\n" * 10)
    (tmp_path / "notes.txt").write_text("not a recording")
    os.utime(tmp_path / "rec-x-1-00001.jsonl", (1_000.0, 1_000.0))
    assert await disk.listing() == [RecFile("rec-x-1-00001.jsonl", 20, 1_000.0)]
    await disk.remove(["rec-x-1-00001.jsonl", "rec-x-1-00002.jsonl"])  # one already gone
    assert await disk.listing() == []
    assert (tmp_path / "notes.txt").exists()


# --- rotation -----------------------------------------------------------------------


def test_rotation_by_size_keeps_lines_whole() -> None:
    rot = Rotation(max_bytes=10, max_age=100.0)
    assert rot.plan([b"aaaa\n", b"bbbb\n"], now=0.0) == [Chunk(1, True, b"aaaa\nbbbb\n", 2)]
    # The next line would pass 10 bytes: a new file.
    assert rot.plan([b"cc\n", b"dd\n"], now=1.0) == [Chunk(2, True, b"cc\ndd\n", 2)]
    # A line larger than the limit gets a file of its own, uncut.
    big = b"x" * 25 + b"\n"
    assert rot.plan([big, b"e\n"], now=2.0) == [Chunk(3, True, big, 1), Chunk(4, True, b"e\n", 1)]


def test_rotation_by_age() -> None:
    rot = Rotation(max_bytes=1000, max_age=60.0)
    assert rot.deadline() == float("inf")
    assert rot.plan([b"a\n"], now=10.0) == [Chunk(1, True, b"a\n", 1)]
    assert rot.deadline() == 70.0
    assert rot.plan([b"b\n"], now=69.0) == [Chunk(1, False, b"b\n", 1)]
    assert rot.plan([b"c\n"], now=70.0) == [Chunk(2, True, b"c\n", 1)]
    rot.close()
    assert rot.plan([b"d\n"], now=71.0) == [Chunk(3, True, b"d\n", 1)]


async def test_files_rotate_by_size_on_disk(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    app = App(record_config(tmp_path, "rotate_bytes = 1500"))
    async with serving(app) as client:
        for i in range(12):
            await client.chat(chat_body(f"request {i}"))
    files = recording_files(tmp_path)
    assert len(files) > 3
    for f in files:
        data = f.read_bytes()
        assert data.endswith(b"\n")
        assert len(data) <= 1500 or data.count(b"\n") == 1
    lines = read_lines(tmp_path)
    assert [line["body"]["messages"][0]["content"] for line in lines] == [f"request {i}" for i in range(12)]
    assert len({f.name.rsplit("-", 1)[0] for f in files}) == 1  # one prefix, numbered files


async def test_an_idle_file_is_closed_when_its_time_is_up(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    app = App(record_config(tmp_path, "rotate_s = 60"))
    assert app.recorder is not None
    disk = app.recorder.disk = FailingDisk(failures=0)
    async with serving(app) as client:
        await client.chat(chat_body("a"))
        await trio.sleep(59)
        assert disk.closed == []
        await trio.sleep(2)
        assert len(disk.closed) == 1  # closed with no new record to trigger it
        await client.chat(chat_body("b"))
    assert len(disk.files) == 2


class HungFile:
    """A file whose write never returns (a stale network mount)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def write(self, data: bytes) -> int:
        self.release.wait(30)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.slow
async def test_a_hung_disk_does_not_hold_the_apps_exit(tmp_path: Path) -> None:
    # Real time, a real disk thread: the write blocks inside the thread, where no
    # cancel scope reaches. Shutdown gives the writer its grace, then leaves it.
    app = App(record_config(tmp_path))
    assert app.recorder is not None
    app.recorder.grace = 0.2
    disk = app.recorder.disk
    assert isinstance(disk, ThreadDisk)
    release = threading.Event()
    real_open = disk.open

    async def open_hung(name: str) -> None:
        await real_open(name)
        assert disk._file is not None
        disk._file.close()
        disk._file = HungFile(release)  # type: ignore[assignment]

    disk.open = open_hung  # type: ignore[method-assign]
    t0 = trio.current_time()
    try:
        async with serving(app, as_lifespan=True) as client:
            await client.chat(chat_body("x", stream=False))
            await trio.sleep(0.1)  # the writer is now stuck in its thread
    finally:
        release.set()
    assert trio.current_time() - t0 < 3.0
