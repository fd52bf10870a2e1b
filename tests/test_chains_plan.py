"""Chains without sockets: the step tables, the checks between steps, the plan and its cuts."""

from __future__ import annotations

import re

import pytest

from aiserve_trio.chains.plan import build_plan, match_rules, route_choice
from aiserve_trio.chains.steps import ClassifyStep, GenerateStep, RouteStep
from aiserve_trio.config import ConfigError, RouteConfig

from .conftest import make_config

ADAPTERS = """
[adapters.big]
kind = "mock"
models = ["aiserve-mock-large"]

[adapters.ws]
kind = "vllm_ws"
url = "ws://127.0.0.1:1/v1/ws"
models = ["ws-model"]
"""
HEAD = ADAPTERS + """
[[routes]]
path = "/v1/bank"
adapter = "mock"
"""
#: The route comes after the embedded default's own: its steps are routes[N].steps[...].
N = len(make_config().routes)
R = f"routes[{N}]"


def step(kind: str, **keys: str) -> str:
    lines = [f'kind = "{kind}"', *(f"{k} = {v}" for k, v in keys.items())]
    return "[[routes.steps]]\n" + "\n".join(lines) + "\n"


def chain(*steps: str) -> RouteConfig:
    return make_config(HEAD + "".join(steps)).routes[N]


def refused(*steps: str, extra: str = "") -> str:
    with pytest.raises(ConfigError) as info:
        make_config(HEAD + extra + "".join(steps))
    message = str(info.value)
    assert "\n" not in message  # one line, the file first
    assert message.startswith("<test>: ")
    return message


# --- the tables ----------------------------------------------------------------------


def test_a_plain_route_has_no_steps() -> None:
    cfg = make_config()
    assert [r.steps for r in cfg.routes] == [[]] * N


def test_steps_decode_into_their_kinds_named_after_them_by_default() -> None:
    route = chain(
        step("transcribe"),
        step("classify", labels='["mortgage"]'),
        step("route", when='{ mortgage = { adapter = "big" } }'),
        step("generate", name='"answer"'),
        step("rewrite", policy='"no-rate-figures"'),
    )
    assert [s.name for s in route.steps] == ["transcribe", "classify", "route", "answer", "rewrite"]
    assert isinstance(route.steps[1], ClassifyStep)
    assert route.steps[1].key == "intent"
    assert isinstance(route.steps[2], RouteStep)
    assert route.steps[2].when["mortgage"].adapter == "big"


@pytest.mark.parametrize(
    ("steps", "key", "why"),
    [
        ((step("speak"),), f"{R}.steps[0].kind", "Invalid value 'speak'"),
        ((step("generate", colour='"red"'),), f"unknown key `{R}.steps[0].colour`", ""),
        ((step("generate", share="1.5"),), f"{R}.steps[0].share", "must be in (0, 1]"),
        ((step("generate", share="0"),), f"{R}.steps[0].share", "must be in (0, 1]"),
        ((step("generate", name='"Answer"'),), f"{R}.steps[0].name", "must match"),
        ((step("classify"), step("generate")), f"{R}.steps[0]", "needs `rules`, `labels`"),
        ((step("classify", labels='["a b"]'),), f"{R}.steps[0].labels[0]", "must match"),
        ((step("classify", labels='["a", "a"]'),), f"{R}.steps[0].labels[1]", "listed twice"),
        (
            (step("classify", rules='[{ label = "a", pattern = "(" }]'),),
            f"{R}.steps[0].rules[0].pattern",
            "not a regular expression",
        ),
        (
            (step("classify", rules='[{ label = "a", pattern = "a" }]', adapter='"big"'),),
            f"{R}.steps[0].adapter",
            "needs `labels`",
        ),
        (
            (step("rewrite", policy='"no-rate-figures"', model='"m"'),),
            f"{R}.steps[0].model",
            "a `policy` rewrite has none",
        ),
        ((step("route"),), f"{R}.steps[0]", "needs `when` tables"),
        ((step("route", when='{ a = {} }'),), f"{R}.steps[0]", "say what to do"),
    ],
)
def test_a_table_that_is_wrong_on_its_own_is_refused_naming_the_key(
    steps: tuple[str, ...], key: str, why: str
) -> None:
    message = refused(*steps)
    assert key in message
    assert why in message


# --- the checks between steps ------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "key", "why"),
    [
        (
            (step("generate", name='"a"'), step("generate", name='"a"')),
            "steps[1].name",
            "'a' is the name of steps[0]",
        ),
        ((step("generate", adapter='"nope"'),), "steps[0].adapter", "unknown adapter 'nope'"),
        (
            (step("generate", model='"gpt-9"'),),
            "steps[0].model",
            "'gpt-9' is not served by adapter 'mock'",
        ),
        (
            (step("generate"), step("rewrite", policy='"no-such-policy"')),
            "steps[1].policy",
            "unknown policy 'no-such-policy'",
        ),
        (
            (step("generate"), step("rewrite", policy='"anti-fraud-v2"')),
            "steps[1].policy",
            "'anti-fraud-v2' does not rewrite output",
        ),
        ((step("transcribe", adapter='"ws"'), step("generate")), "steps[0].adapter", "cannot transcribe"),
        ((step("transcribe"),), "steps", "needs an enabled `generate` step"),
        ((step("generate", enabled="false"),), "steps", "needs an enabled `generate` step"),
        (
            (step("generate"), step("classify", labels='["a"]')),
            "steps[1].kind",
            "only policy rewrites may follow 'generate'",
        ),
        (
            (step("rewrite", policy='"no-rate-figures"'), step("generate")),
            "steps[0].kind",
            "needs a generate step before it",
        ),
        (
            (step("route", when='{ a = { goto = "nowhere" } }'), step("generate")),
            "steps[0].when.a.goto",
            "no step is named 'nowhere'",
        ),
        (
            (
                step("classify", labels='["a"]'),
                step("route", when='{ a = { goto = "classify" } }'),
                step("generate"),
            ),
            "steps[1].when.a.goto",
            "a goto only goes forward",
        ),
        (
            (
                step("route", when='{ a = { goto = "rewrite" } }'),
                step("generate"),
                step("rewrite", policy='"no-rate-figures"'),
            ),
            "steps[0].when.a.goto",
            "comes after 'generate', the step that streams",
        ),
        (
            (
                step("route", otherwise='{ goto = "polish" }'),
                step("generate", name='"draft"'),
                step("rewrite", name='"polish"'),
            ),
            "steps[0].otherwise.goto",
            "would skip the generate step 'draft'",
        ),
        (
            (step("generate"), step("route", when='{ a = { adapter = "big" } }')),
            "steps[1].kind",
            "only policy rewrites may follow",
        ),
        (
            (step("route", when='{ a = { adapter = "nope" } }'), step("generate")),
            "steps[0].when.a.adapter",
            "unknown adapter 'nope'",
        ),
        (
            (step("route", when='{ a = { model = "gpt-9" } }'), step("generate")),
            "steps[0].when.a.model",
            "not served by adapter 'mock'",
        ),
        (
            (
                step("route", when='{ a = { adapter = "big" } }'),
                step("generate", enabled="false"),
                step("generate", name='"g2"', adapter='"big"'),
                step("rewrite", name='"r"', adapter='"big"'),
            ),
            "",
            "",
        ),
        (
            (step("transcribe", share="0.7"), step("generate", share="0.5")),
            "steps",
            "shares sum to 1.200; at most 1",
        ),
        (
            (step("transcribe"), step("classify", labels='["a"]', share="1.0"), step("generate")),
            "steps[0].share",
            "leave this step no time",
        ),
    ],
)
def test_a_chain_that_cannot_run_is_refused_naming_the_key(
    steps: tuple[str, ...], key: str, why: str
) -> None:
    if not key:  # the control case of the list: valid as it is
        chain(*steps)
        return
    message = refused(*steps)
    assert f"key `{R}.{key}`" in message
    assert why in message


def test_the_route_level_rules() -> None:
    cache = refused(step("generate"), extra="cache = { ttl_s = 10 }\n")
    assert f"key `{R}.cache`" in cache
    assert "no response cache" in cache
    embed = make_config
    with pytest.raises(ConfigError, match=re.escape(f"key `{R}.steps`: steps are for chat routes")):
        embed(HEAD.replace('adapter = "mock"', 'adapter = "mock"\nkind = "embeddings"') + step("generate"))


def test_a_disabled_step_is_not_checked_for_its_place() -> None:
    # A classify after the streaming step is refused, unless it is switched off.
    route = chain(step("generate"), step("classify", labels='["a"]', enabled="false"))
    assert [s.name for s in build_plan(route.steps).steps] == ["generate"]


# --- the plan ---------------------------------------------------------------------------


def test_default_shares_by_kind_sum_to_the_whole_budget() -> None:
    route = chain(
        step("transcribe"),
        step("classify", labels='["a"]'),
        step("route", when='{ a = { adapter = "big" } }'),
        step("generate"),
        step("rewrite", policy='"no-rate-figures"'),
    )
    plan = build_plan(route.steps)
    shares = {s.name: s.share for s in plan.steps}
    # transcribe 0.2, classify 0.1, generate 0.5 (no model rewrite here): scaled to 1.
    assert shares == pytest.approx(
        {"transcribe": 0.25, "classify": 0.125, "route": 0.0, "generate": 0.625, "rewrite": 0.0}
    )
    assert [s.calls for s in plan.steps] == [True, True, False, True, False]
    assert [s.streams for s in plan.steps] == [False, False, False, True, False]
    assert [s.filters for s in plan.steps] == [False, False, False, False, True]
    # Cumulative cut points from the chain's start: the streaming step and the
    # policy that filters it run to the end.
    assert plan.cuts(10.0, 12.0) == pytest.approx((10.5, 10.75, 10.75, 12.0, 12.0))


def test_an_explicit_share_is_kept_and_the_others_split_the_rest() -> None:
    plan = build_plan(
        chain(
            step("transcribe", share="0.4"),
            step("classify", labels='["a"]'),
            step("generate", name='"draft"'),
            step("rewrite", name='"polish"'),
        ).steps
    )
    shares = [s.share for s in plan.steps]
    # 0.6 left for classify 0.1 : draft 0.5 : polish 0.2.
    assert shares == pytest.approx([0.4, 0.6 * 0.1 / 0.8, 0.6 * 0.5 / 0.8, 0.6 * 0.2 / 0.8])
    assert [s.streams for s in plan.steps] == [False, False, False, True]
    cuts = plan.cuts(0.0, 1.0)
    assert cuts == pytest.approx((0.4, 0.475, 0.85, 1.0))


def test_a_disabled_step_is_left_out_and_its_time_goes_to_the_others() -> None:
    plan = build_plan(chain(step("transcribe", enabled="false"), step("generate")).steps)
    assert [(s.name, s.share) for s in plan.steps] == [("generate", 1.0)]
    assert not plan.transcribes


def test_a_late_start_leaves_no_time_rather_than_negative_time() -> None:
    plan = build_plan(chain(step("transcribe"), step("generate")).steps)
    assert plan.cuts(5.0, 4.0) == (5.0, 4.0)


def test_a_goto_to_a_disabled_step_lands_on_the_next_enabled_one() -> None:
    plan = build_plan(
        chain(
            step("route", when='{ a = { goto = "skipme" } }'),
            step("classify", labels='["x"]'),
            step("classify", name='"skipme"', labels='["y"]', enabled="false"),
            step("generate"),
        ).steps
    )
    assert [s.name for s in plan.steps] == ["route", "classify", "generate"]
    assert plan.goto("skipme") == 2
    assert plan.goto("generate") == 2


def test_rules_match_in_order_and_route_choices_by_label() -> None:
    route = chain(
        step(
            "classify",
            rules='[{ label = "mortgage", pattern = "mortgage|房贷" }, { label = "card", pattern = "card" }]',
        ),
        step(
            "route",
            when='{ mortgage = { adapter = "big" } }',
            otherwise='{ model = "aiserve-mock" }',
        ),
        step("generate"),
    )
    plan = build_plan(route.steps)
    rules = plan.steps[0].rules
    assert match_rules(rules, "My CARD and my mortgage") == "mortgage"  # the first rule wins
    assert match_rules(rules, "我的房贷") == "mortgage"
    assert match_rules(rules, "hello") is None
    router = route.steps[1]
    assert isinstance(router, RouteStep)
    assert isinstance(route.steps[2], GenerateStep)
    choice = route_choice(router, {"intent": "mortgage"})
    assert choice is not None
    assert choice.adapter == "big"
    other = route_choice(router, {})
    assert other is not None
    assert other.model == "aiserve-mock"
