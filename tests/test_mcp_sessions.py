"""/mcp's session table: a tenant that opens sessions in bulk evicts its own first."""

from __future__ import annotations

import pytest

from aiserve_trio.mcp.sessions import Session, SessionTable


def _open(table: SessionTable, tenant: str, n: int) -> list[str]:
    sids = [f"{tenant}-{i}" for i in range(n)]
    for sid in sids:
        table.add(sid, Session(f"key-{tenant}", "2025-06-18", tenant))
    return sids


def test_a_tenant_flooding_the_table_evicts_its_own_sessions_not_anothers() -> None:
    table = SessionTable(limit=100)
    bank = _open(table, "bank", 10)
    flood = _open(table, "flood", 1_000)
    assert len(table) == 100
    assert all(table.get(sid) is not None for sid in bank)
    # The flooder keeps its newest 90; its oldest went first.
    assert [sid for sid in flood if table.get(sid) is not None] == flood[-90:]


def test_within_a_tenant_the_least_recently_used_goes_first() -> None:
    table = SessionTable(limit=3)
    first, second, third = _open(table, "t", 3)
    assert table.get(first) is not None  # used: now the tenant's most recent
    evicted = table.add("t-new", Session("key-t", "2025-06-18", "t"))
    assert [s.key_id for s in evicted] == ["key-t"]
    assert table.get(second) is None
    assert table.get(first) is not None
    assert table.get(third) is not None


def test_while_there_is_room_a_tenant_may_use_all_of_it() -> None:
    table = SessionTable(limit=50)
    sids = _open(table, "alone", 50)
    assert all(table.get(sid) is not None for sid in sids)


def test_a_deleted_session_is_gone_and_frees_its_room() -> None:
    table = SessionTable(limit=2)
    a, b = _open(table, "t", 2)
    assert table.remove(a).tenant == "t"
    assert table.get(a) is None
    assert table.add("t-c", Session("key-t", "2025-06-18", "t")) == []
    assert table.get(b) is not None
    with pytest.raises(KeyError):
        table.remove(a)
