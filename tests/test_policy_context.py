"""A policy's context is one request's (issue 45, item 5): what the policies record on
it (their actions, their counts, their flags) never reaches another request."""

from __future__ import annotations

from typing import Any

import pytest

from aiserve_trio.policies.base import PolicyContext, redact_values

from .asgi_client import Client
from .test_session_scope import KEY_IVR, SID, app, fill, h
from .test_sessions_http import running


async def test_each_redacted_session_read_has_a_context_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[PolicyContext, int]] = []

    def spy(values: Any, policies: Any, ctx: PolicyContext, clear: Any) -> Any:
        seen.append((ctx, len(ctx.actions)))
        return redact_values(values, policies, ctx, clear)

    monkeypatch.setattr("aiserve_trio.runtime.builder.redact_values", spy)
    async with running(app()) as a:
        client = Client(a)
        await fill(client)
        for _ in range(2):
            r = await client.request("GET", f"/v1/sessions/{SID}", headers=h(KEY_IVR))
            assert r.status == 200, r.body
            assert r.json()["variables"]["contact"] == "[EMAIL]"  # redacted on each read
    contexts = [ctx for ctx, _ in seen]
    assert len(contexts) >= 2
    assert len({id(c) for c in contexts}) == len(contexts)  # none shared
    assert [before for _, before in seen] == [0] * len(seen)  # each starts empty
    assert all(ctx.actions == [("gdpr-redact", "redacted")] for ctx in contexts)
