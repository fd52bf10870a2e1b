"""The mock adapter's rule engine (pure) and its pacing."""

import pytest
import trio

from aiserve_trio.adapters.base import Delta, InferenceRequest, Message
from aiserve_trio.adapters.mock import MockAdapter, RuleEngine, fill_template, split_words
from aiserve_trio.config import MockAdapterConfig, MockRule


def engine(*rules: tuple[str, str], default: str = "default {x|?}") -> RuleEngine:
    return RuleEngine(
        MockAdapterConfig(
            rules=[MockRule(pattern=p, reply=r) for p, r in rules], default_reply=default
        )
    )


def user(text: str) -> list[Message]:
    return [Message(role="system", content="sys"), Message(role="user", content=text)]


@pytest.mark.parametrize("text", ["hello", "a  b\n c\t", "  lead", "trail  ", "标点 符号 ok"])
def test_split_words_concatenates_back_exactly(text):
    assert "".join(split_words(text)) == text


def test_echo_is_verbatim_and_wins_over_rules():
    e = engine(("echo", "rule reply"))
    assert e.reply(user("echo: keep  this\nexactly "), {}).text == "keep  this\nexactly "
    assert e.reply(user("echo:x"), {}).text == "x"


def test_first_matching_rule_wins_case_insensitively_with_groups_and_variables():
    e = engine((r"rate for (?P<product>\w+)", "{product} at {rate|unknown}"), ("rate", "second"))
    assert e.reply(user("RATE FOR loans?"), {"rate": "3%"}).text == "loans at 3%"
    assert e.reply(user("rate for cars"), {}).text == "cars at unknown"
    assert e.reply(user("nothing"), {"x": "1"}).text == "default 1"


def test_only_the_last_user_message_is_matched():
    e = engine(("mortgage", "M"))
    msgs = [
        Message(role="user", content="mortgage"),
        Message(role="assistant", content="M"),
        Message(role="user", content="thanks"),
    ]
    assert e.reply(msgs, {}).text == "default ?"


def test_unknown_template_names_are_left_as_written():
    assert fill_template("{a} {b|fb} {c}", {"a": "1"}) == "1 fb {c}"


async def test_stream_paces_words_and_reports_usage(autojump_clock):
    adapter = MockAdapter("mock", MockAdapterConfig(ttft_ms=100, inter_token_ms=10))
    send, recv = trio.open_memory_channel[Delta](100)
    req = InferenceRequest(
        request_id="r", model="aiserve-mock", messages=user("echo: a b c"), deadline=1e9
    )
    t0 = trio.current_time()
    async with send:
        await adapter.stream(req, send)
    assert trio.current_time() - t0 == pytest.approx(0.120)
    got = [d async for d in recv]
    assert [d.text for d in got[:-1]] == ["a", " b", " c"]
    assert got[-1].finish_reason == "stop"
    assert got[-1].usage is not None
    assert got[-1].usage.completion_tokens == 3
