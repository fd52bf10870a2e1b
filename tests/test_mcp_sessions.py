"""/mcp's session ids: signed, so any worker with the secret reads them; nothing stored."""

from __future__ import annotations

import base64

from aiserve_trio.mcp.sessions import MAX_ID, Ended, SessionIds

SECRET = b"s" * 32


def test_an_id_is_read_back_by_any_reader_with_the_same_key() -> None:
    issued = SessionIds(SECRET).issue("agent", "2025-06-18")
    read = SessionIds(SECRET).read(issued)  # another worker
    assert read is not None
    assert (read.sid, read.key_id, read.version) == (issued, "agent", "2025-06-18")
    assert SessionIds(SECRET).issue("agent", "2025-06-18") != issued  # a nonce each
    assert issued.isascii()
    assert issued.isprintable()  # visible ASCII, as the transport asks


def test_another_secrets_id_or_an_altered_one_is_not_a_session() -> None:
    ids = SessionIds(SECRET)
    issued = ids.issue("agent", "2025-06-18")
    assert SessionIds(b"t" * 32).read(issued) is None
    body, _, sig = issued.rpartition(".")
    # The same signature over a body naming another key.
    forged = base64.urlsafe_b64encode(b"2025-06-18|xyz|admin").decode().rstrip("=")
    assert ids.read(f"{forged}.{sig}") is None
    assert ids.read(body) is None
    assert ids.read(issued[:-2] + ("AA" if not issued.endswith("AA") else "BB")) is None
    assert ids.read("x" * (MAX_ID + 1)) is None
    assert ids.read("not base64!.sig") is None


def test_a_session_without_a_key_reads_back_as_none() -> None:
    ids = SessionIds(SECRET)
    read = ids.read(ids.issue(None, "2024-11-05"))
    assert read is not None
    assert read.key_id is None


def test_ended_ids_are_remembered_up_to_the_limit_newest_kept() -> None:
    ended = Ended(limit=3)
    for sid in ("a", "b", "c", "d"):
        ended.add(sid)
    assert len(ended) == 3
    assert "a" not in ended
    assert all(sid in ended for sid in ("b", "c", "d"))
