"""Label rules on a table of bodies: the design's three defaults, metadata labels, custom rules."""

from __future__ import annotations

import re
from typing import Any

import pytest

from aiserve_trio.config import ConfigError
from aiserve_trio.record.labels import LabelRules, last_user_text, messages_chars
from aiserve_trio.record.settings import LabelRule, RecordConfig, default_rules

from .conftest import make_config


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "aiserve-mock", "messages": list(messages), **extra}


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
LONG = "x" * 1501

#: (id, body, the labels the default rules give it)
TABLE: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("plain", body(user("hello")), {}),
    ("select", body(user("SELECT id FROM cards WHERE limit > 5")), {"intent": "sql"}),
    ("join", body(user("why is a JOIN slow?")), {"intent": "sql"}),
    ("lower case is prose", body(user("please select a card and join the plan")), {}),
    ("a longer word", body(user("JOINED and SELECTED")), {}),
    ("keyword at the ends", body(user("JOIN")), {"intent": "sql"}),
    (
        "only the last user message counts",
        body(user("SELECT 1"), {"role": "assistant", "content": "1"}, user("thanks")),
        {},
    ),
    (
        "the assistant's SQL does not",
        body(user("write a query"), {"role": "assistant", "content": "SELECT 1"}, user("and?")),
        {},
    ),
    (
        "text parts",
        body(user([{"type": "text", "text": "run "}, {"type": "text", "text": "SELECT 1"}])),
        {"intent": "sql"},
    ),
    ("1500 characters are not above 1500", body(user("x" * 1500)), {}),
    ("1501 characters", body(user(LONG)), {"complexity": "high"}),
    (
        "characters of every message",
        body({"role": "system", "content": "s" * 1000}, user("u" * 501)),
        {"complexity": "high"},
    ),
    ("tools", body(user("hi"), tools=[TOOL]), {"has_tools": "true"}),
    ("tool_choice alone", body(user("hi"), tool_choice="none"), {"has_tools": "true"}),
    (
        "all three",
        body(user("SELECT " + LONG), tools=[TOOL], tool_choice="auto"),
        {"intent": "sql", "complexity": "high", "has_tools": "true"},
    ),
    (
        "a classify label in metadata wins",
        body(user("SELECT 1"), metadata={"intent": "mortgage"}),
        {"intent": "mortgage"},
    ),
    (
        "metadata keys not named are no labels",
        body(user("hi"), metadata={"tier": "gold", "intent": "card_limit"}),
        {"intent": "card_limit"},
    ),
    (
        "a metadata value the weights cannot name is ignored",
        body(user("hi"), metadata={"intent": "call me at 5"}),
        {},
    ),
    ("no messages at all", {"model": "m"}, {}),
]


@pytest.mark.parametrize(("name", "request_body", "expected"), TABLE, ids=[t[0] for t in TABLE])
def test_the_default_rules_label_the_table(
    name: str, request_body: dict[str, Any], expected: dict[str, str]
) -> None:
    rules = LabelRules(default_rules(), RecordConfig().metadata_labels)
    assert rules.labels(request_body) == expected


def test_text_helpers() -> None:
    b = body(user("a"), {"role": "assistant", "content": None}, user([{"type": "image_url"}]))
    assert last_user_text(b) == ""
    assert messages_chars(body(user("abc"), {"role": "system", "content": "de"})) == 5


def test_custom_rules_regex_case_scope_and_order() -> None:
    rules = LabelRules(
        [
            LabelRule(label="intent", value="card", regex=r"\bcredit card\b", ignore_case=True),
            LabelRule(label="intent", value="sql", keywords=["select"], ignore_case=True),
            LabelRule(label="lang", value="zh", regex=r"[\u4e00-\u9fff]", scope="messages"),
            LabelRule(label="both", keywords=["JOIN"], regex="ON"),
        ]
    )
    assert rules.labels(body(user("My Credit Card, select it"))) == {"intent": "card"}
    assert rules.labels(body(user("select 1"))) == {"intent": "sql"}
    assert rules.labels(body({"role": "system", "content": "用中文"}, user("hi"))) == {"lang": "zh"}
    assert rules.labels(body(user("a JOIN b ON x"))) == {"both": "true"}
    assert rules.labels(body(user("a JOIN b"))) == {}


def test_the_config_carries_rules_and_defaults() -> None:
    assert make_config().record.labels == default_rules()
    assert not make_config().record.enabled
    cfg = make_config(
        """
[record]
enabled = true
metadata_labels = ["intent", "classify"]

[[record.labels]]
label = "lang"
value = "zh"
regex = '[\\u4e00-\\u9fff]'
"""
    )
    assert [r.label for r in cfg.record.labels] == ["lang"]
    assert cfg.record.metadata_labels == ["intent", "classify"]


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[record]\nsample = 1.5", "record.sample"),
        ("[record]\nbuffer = 0", "record.buffer"),
        ("[record]\nrotate_bytes = -1", "record.rotate_bytes"),
        ("[record]\ncolour = 1", "record.colour"),
        ('[record]\nroutes = ["/v1/none"]', "record.routes[0]"),
        ('[record]\nmetadata_labels = ["Bad"]', "record.metadata_labels[0]"),
        ('[[record.labels]]\nlabel = "x"', "record.labels[0]"),
        ('[[record.labels]]\nlabel = "x"\nregex = "("', "record.labels[0].regex"),
        ('[[record.labels]]\nlabel = "X"\nfields = ["tools"]', "record.labels[0].label"),
        ('[[record.labels]]\nlabel = "x"\nvalue = "a:b"\nfields = ["t"]', "record.labels[0].value"),
    ],
)
def test_a_bad_record_section_is_refused_naming_the_key(toml: str, key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"`{key}")) as err:
        make_config(toml)
    assert "<test>" in str(err.value)
