"""Chains end to end on the virtual clock: the mock plays every part (no backend at all)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import trio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from aiserve_trio.adapters.base import Adapter, InferenceRequest, TranscriptionRequest
from aiserve_trio.adapters.mock import MockAdapter, count_tokens
from aiserve_trio.config import MockAdapterConfig
from aiserve_trio.record.labels import LabelRules
from aiserve_trio.record.line import LineBuilder
from aiserve_trio.record.settings import default_rules
from aiserve_trio.runtime.asgi import App
from aiserve_trio.stages.outcome import Outcome
from aiserve_trio.util.wav import audio_part, make_wav

from .asgi_client import Client, Response
from .conftest import make_config
from .fakes import RecordingAdapter

PATH = "/v1/bank"
#: X-Request-Timeout-Ms 1100 less the 100 ms reserve: T = 1 s; the inference cut is at 0.75 s.
TIMEOUT = {"x-request-timeout-ms": "1100"}

MOCKS = """
[adapters.big]
kind = "mock"
models = ["aiserve-mock-large"]
ttft_ms = 10
inter_token_ms = 5
default_reply = "The large model says the rate is 3.85% a year."

[adapters.slow]
kind = "mock"
models = ["aiserve-mock"]
ttft_ms = 500
inter_token_ms = 5

[adapters.duo]
kind = "mock"
models = ["aiserve-mock", "aiserve-mock-alt"]
ttft_ms = 10
inter_token_ms = 5
default_reply = "intent={intent|none}"

[adapters.editor]
kind = "mock"
models = ["aiserve-editor"]
ttft_ms = 10
inter_token_ms = 5

[[adapters.editor.rules]]
pattern = '^(?P<draft>.+)$'
reply = "Edited: {draft}"
"""

BANK = """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"

[[routes.steps]]
name = "asr"
kind = "transcribe"
share = 0.2

[[routes.steps]]
name = "intent"
kind = "classify"
labels = ["mortgage", "instalment"]
share = 0.1

[[routes.steps]]
name = "pick"
kind = "route"
[routes.steps.when.mortgage]
adapter = "big"

[[routes.steps]]
kind = "generate"

[[routes.steps]]
name = "comply"
kind = "rewrite"
policy = "no-rate-figures"
"""


class Recorder(RecordingAdapter):
    """A recording adapter that also records transcriptions, into a log shared by all."""

    def __init__(self, inner: Adapter, log: list[tuple[str, Any]]) -> None:
        super().__init__(inner)
        self.log = log

    async def attempt(self, request: InferenceRequest, send: Any, progress: Any) -> None:
        self.log.append((self.name, request))
        await super().attempt(request, send, progress)

    async def transcribe_once(self, request: TranscriptionRequest) -> str:
        self.log.append((self.name, request))
        return await self.inner.transcribe_once(request)


def chain_app(routes: str, **kwargs: Any) -> tuple[App, list[tuple[str, Any]]]:
    cfg = make_config(MOCKS + routes)
    log: list[tuple[str, Any]] = []
    adapters: dict[str, Adapter] = {}
    for name, acfg in cfg.adapters.items():
        if isinstance(acfg, MockAdapterConfig):
            adapters[name] = Recorder(MockAdapter(name, acfg), log)
    return App(cfg, adapters=adapters, **kwargs), log


def spoken(text: str | None, *extra: dict[str, Any], **body: Any) -> dict[str, Any]:
    """A chat request whose user message is a WAV saying ``text`` (then ``extra`` parts)."""
    content = [audio_part(make_wav(text, seconds=0.5)), *extra]
    return {"model": "aiserve-mock", "messages": [{"role": "user", "content": content}], **body}


def typed(text: str, **body: Any) -> dict[str, Any]:
    return {"model": "aiserve-mock", "messages": [{"role": "user", "content": text}], **body}


async def post(app: App, body: dict[str, Any], path: str = PATH, **headers: str) -> Response:
    return await Client(app).request("POST", path, json_body=body, headers={**TIMEOUT, **headers})


def content(r: Response) -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        return r.text()
    text: str = r.json()["choices"][0]["message"]["content"]
    return text


def error_event(r: Response) -> dict[str, Any]:
    events = r.events()
    assert events[-1] == "[DONE]"
    error: dict[str, Any] = json.loads(events[-2])["error"]
    return error


def metadata_of(request: InferenceRequest) -> dict[str, Any]:
    raw = request.extra.get("metadata")
    return dict(msgspec.json.decode(raw)) if raw is not None else {}


# --- order, deadlines, headers ------------------------------------------------------------


async def test_steps_run_in_order_each_by_its_own_cut_point(autojump_clock):
    app, log = chain_app(BANK)
    t0 = trio.current_time()
    r = await post(app, spoken("I want a mortgage"))
    assert r.status == 200, r.body
    assert r.headers["x-aiserve-steps"] == "asr,intent,pick,generate,comply"
    (asr_at, asr), (intent_at, classify), (gen_at, generate) = log
    assert [asr_at, intent_at, gen_at] == ["mock", "mock", "big"]
    # The chain's budget is the time left to the inference cut (0.75 s here, the
    # context stage having taken none): asr by 20 % of it, intent by 30 %, the
    # streaming step by the cut itself.
    assert isinstance(asr, TranscriptionRequest)
    assert asr.deadline == pytest.approx(t0 + 0.15)
    assert asr.format == "wav"
    assert asr.model == "aiserve-mock"
    assert isinstance(classify, InferenceRequest)
    assert classify.deadline == pytest.approx(t0 + 0.225)
    assert classify.messages[0].role == "system"
    assert "Labels: mortgage, instalment" in classify.messages[0].text()
    assert classify.messages[1].text() == "I want a mortgage"  # the transcript, not the audio
    assert (classify.max_tokens, classify.temperature) == (16, 0.0)
    assert isinstance(generate, InferenceRequest)
    assert generate.deadline == pytest.approx(t0 + 0.75)
    assert generate.model == "aiserve-mock-large"
    assert generate.messages[-1].text() == "I want a mortgage"
    assert generate.variables["intent"] == "mortgage"
    assert metadata_of(generate) == {"intent": "mortgage"}
    # The large model answered (the route step chose it), through the compliance pack.
    assert r.headers["x-aiserve-deployment"] == "big"
    reply = content(r)
    assert reply == "The large model says the rate is [rate available from your adviser] a year."
    assert r.json()["model"] == "aiserve-mock-large"  # the reply names the model that answered


async def test_a_streamed_chain_filters_the_stream_and_says_which_steps_ran(autojump_clock):
    app, _ = chain_app(BANK)
    r = await post(app, spoken("mortgage rates?", stream=True))
    assert r.status == 200
    assert r.headers["x-aiserve-steps"] == "asr,intent,pick,generate,comply"
    assert r.text() == "The large model says the rate is [rate available from your adviser] a year."
    assert all("3.85" not in event for event in r.events())
    assert r.events()[-1] == "[DONE]"
    assert {json.loads(e)["model"] for e in r.events()[:-1]} == {"aiserve-mock-large"}


async def test_another_label_stays_on_the_routes_adapter(autojump_clock):
    app, log = chain_app(BANK)
    r = await post(app, spoken("I would like to pay in instalments"))
    assert r.status == 200
    assert "x-aiserve-deployment" not in r.headers  # nothing chose another adapter
    assert log[-1][0] == "mock"
    generate = log[-1][1]
    assert isinstance(generate, InferenceRequest)
    assert generate.model == "aiserve-mock"
    assert metadata_of(generate) == {"intent": "instalment"}


async def test_a_plain_route_is_unchanged(autojump_clock):
    app, _ = chain_app(BANK)
    r = await post(app, typed("echo: one two"), path="/v1/chat/completions")
    assert r.status == 200
    assert "x-aiserve-steps" not in r.headers
    assert content(r) == "one two"


# --- deadlines that pass --------------------------------------------------------------------


async def test_a_step_that_passes_its_cut_ends_the_request_with_a_504_naming_it(autojump_clock):
    slow_asr = BANK.replace('kind = "transcribe"\nshare = 0.2', 'kind = "transcribe"\nadapter = "slow"\nshare = 0.1')
    app, log = chain_app(slow_asr)
    t0 = trio.current_time()
    r = await post(app, spoken("I want a mortgage"))
    assert r.status == 504
    error = r.json()["error"]
    assert error["param"] == "asr"
    assert error["code"] == "step_deadline_exceeded"
    assert error["type"] == "timeout"
    assert "'asr'" in error["message"]
    assert r.headers["x-aiserve-steps"] == "asr"
    assert [name for name, _ in log] == ["slow"]  # nothing after it ran
    # Cut at 10 % of the 0.75 s chain budget; the histogram saw that long a step.
    assert trio.current_time() - t0 == pytest.approx(0.075)
    latency = app.metrics.registry.get_sample_value(
        "aiserve_chain_step_latency_seconds_sum", {"route": "bank", "step": "asr"}
    )
    assert latency == pytest.approx(0.075)
    expiries = app.metrics.registry.get_sample_value("aiserve_stage_deadline_expiries_total", {"stage": "asr"})
    assert expiries == 1.0


async def test_the_streaming_step_passing_the_inference_cut_ends_the_stream_naming_it(
    autojump_clock,
):
    app, _ = chain_app(
        """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"
[[routes.steps]]
name = "intent"
kind = "classify"
rules = [{ label = "echo", pattern = "^echo:" }]
[[routes.steps]]
name = "answer"
kind = "generate"
"""
    )
    words = " ".join(f"w{i}" for i in range(200))  # 10 ms + 199 x 5 ms: past the 0.75 s cut
    r = await post(app, typed("echo: " + words, stream=True))
    assert r.status == 200  # the head went out with the first token
    assert r.headers["x-aiserve-steps"] == "intent,answer"
    error = error_event(r)
    assert error["param"] == "answer"
    assert error["code"] == "step_deadline_exceeded"
    assert r.text().startswith("w0 w1")
    counted = app.metrics.registry.get_sample_value
    assert counted("aiserve_stage_deadline_expiries_total", {"stage": "answer"}) == 1.0
    assert counted("aiserve_stage_deadline_expiries_total", {"stage": "inference"}) is None


# --- classify --------------------------------------------------------------------------------

RULES = """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "duo"
[[routes.steps]]
name = "intent"
kind = "classify"
rules = [{ label = "mortgage", pattern = '\\bmortgage' }, { label = "card", pattern = "card" }]
[[routes.steps]]
kind = "generate"
"""


async def test_classify_by_rules_puts_the_label_into_variables_and_metadata(autojump_clock):
    app, log = chain_app(RULES)
    r = await post(app, typed("My mortgage and my card", metadata={"segment": "retail"}))
    assert r.status == 200
    assert content(r) == "intent=mortgage"  # the mock's template read the variable
    ((_, generate),) = log  # rules make no model call
    assert metadata_of(generate) == {"segment": "retail", "intent": "mortgage"}
    r = await post(app, typed("hello"))
    assert content(r) == "intent=other"  # no rule matched: the default label


async def test_the_label_is_kept_in_the_sessions_variables(autojump_clock):
    app, _ = chain_app(RULES)
    r = await post(app, typed("About my mortgage"), **{"x-session-id": "s-7"})
    assert r.status == 200
    s = await Client(app).request("GET", "/v1/sessions/s-7")
    assert s.json()["variables"]["intent"] == "mortgage"
    # The next request on the session sees the last label until a step decides anew.
    r = await post(app, typed("and my card"), **{"x-session-id": "s-7"})
    s = await Client(app).request("GET", "/v1/sessions/s-7")
    assert s.json()["variables"]["intent"] == "card"


async def test_classify_by_model_reads_the_models_answer(autojump_clock):
    app, log = chain_app(
        RULES.replace(
            'rules = [{ label = "mortgage", pattern = \'\\bmortgage\' }, { label = "card", pattern = "card" }]',
            'labels = ["mortgage", "card"]\ndefault_label = "general"',
        )
    )
    r = await post(app, typed("Can I raise my card limit?"))
    assert content(r) == "intent=card"
    (_, classify), (_, generate) = log
    assert "Labels: mortgage, card" in classify.messages[0].text()
    assert classify.extra == {}  # the client's fields are for the answer, not the classifier
    assert generate.variables["intent"] == "card"
    r = await post(app, typed("hello"))  # the mock answers "unknown": not a label
    assert content(r) == "intent=general"


async def test_a_rule_that_matches_saves_the_model_call(autojump_clock):
    app, log = chain_app(
        RULES.replace(
            '[[routes.steps]]\nkind = "generate"',
            'labels = ["mortgage", "card"]\n[[routes.steps]]\nkind = "generate"',
        )
    )
    await post(app, typed("mortgage"))
    assert len(log) == 1
    await post(app, typed("what about my credit card"))  # "card" is a rule too
    assert len(log) == 2
    await post(app, typed("hello"))  # no rule: the model is asked
    assert len(log) == 4


# --- route ------------------------------------------------------------------------------------

ROUTED = """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "duo"
[[routes.steps]]
name = "intent"
kind = "classify"
rules = [{ label = "card", pattern = "card" }, { label = "greeting", pattern = "^(hi|hello)" }]
[[routes.steps]]
name = "pick"
kind = "route"
when = { card = { model = "aiserve-mock-alt" }, greeting = { goto = "answer" } }
[[routes.steps]]
name = "topic"
kind = "classify"
key = "topic"
labels = ["limits", "fees"]
[[routes.steps]]
name = "answer"
kind = "generate"
"""


async def test_a_route_step_changes_the_model_of_the_generate_step(autojump_clock):
    app, log = chain_app(ROUTED)
    await post(app, typed("my card limits"))
    generate = log[-1][1]
    assert generate.model == "aiserve-mock-alt"
    assert generate.variables["topic"] == "limits"
    await post(app, typed("my statement"))
    assert log[-1][1].model == "aiserve-mock"


async def test_a_goto_skips_the_steps_in_between(autojump_clock):
    app, log = chain_app(ROUTED)
    r = await post(app, typed("hello there"))
    assert r.headers["x-aiserve-steps"] == "intent,pick,answer"
    assert len(log) == 1  # the topic classifier was not asked
    r = await post(app, typed("my card"))
    assert r.headers["x-aiserve-steps"] == "intent,pick,topic,answer"


# --- enabled, disabled ---------------------------------------------------------------------


async def test_disabled_steps_are_skipped_and_absent_from_the_header(autojump_clock):
    app, _ = chain_app(BANK.replace('policy = "no-rate-figures"', 'policy = "no-rate-figures"\nenabled = false'))
    r = await post(app, spoken("mortgage"))
    assert r.headers["x-aiserve-steps"] == "asr,intent,pick,generate"
    assert "3.85% a year" in content(r)  # nothing rewrote it


async def test_without_an_enabled_transcribe_step_audio_is_refused_as_before(autojump_clock):
    app, _ = chain_app(BANK.replace('share = 0.2', 'share = 0.2\nenabled = false'))
    r = await post(app, spoken("mortgage"))
    assert r.status == 400
    assert r.json()["error"]["code"] == "unsupported_content"
    assert r.json()["error"]["param"] == "messages[0].content[0]"


# --- transcribe --------------------------------------------------------------------------------

ECHO = """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"
[[routes.steps]]
name = "asr"
kind = "transcribe"
[[routes.steps]]
name = "answer"
kind = "generate"
"""


async def test_the_mock_hears_the_wavs_comment(autojump_clock):
    app, log = chain_app(ECHO)
    r = await post(app, spoken("echo: hello from the phone", {"type": "text", "text": " line"}))
    assert r.status == 200, r.body
    assert content(r) == "hello from the phone line"  # the transcript, then the text part
    assert r.headers["x-aiserve-steps"] == "asr,answer"
    r = await post(app, spoken(None))  # no comment: its length
    assert r.status == 200
    generate = log[-1][1]
    assert generate.messages[-1].text() == "[0.5 seconds of audio without speech]"
    assert generate.messages[-1].part_types() == {"text"}


@pytest.mark.parametrize(
    ("part", "why"),
    [
        ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "not base64"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}, "must be one of wav, mp3"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "not a WAV file"),
        ({"type": "input_audio"}, "must be {"),
    ],
)
async def test_audio_that_cannot_be_heard_is_a_400_naming_the_part(autojump_clock, part, why):
    app, _ = chain_app(ECHO)
    body = {
        "model": "aiserve-mock",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "listen:"}, part]},
        ],
    }
    r = await post(app, body)
    assert r.status == 400
    error = r.json()["error"]
    assert error["param"] == "messages[1].content[1]"
    assert error["code"] == "invalid_audio"
    assert why in error["message"]


async def test_the_session_keeps_what_was_heard_not_the_audio(autojump_clock):
    app, _ = chain_app(ECHO)
    r = await post(app, spoken("echo: call me back"), **{"x-session-id": "s-1"})
    assert r.status == 200
    s = await Client(app).request("GET", "/v1/sessions/s-1")
    turns = s.json()["turns"]
    assert [(t["role"], t["content"]) for t in turns] == [
        ("user", "echo: call me back"),
        ("assistant", "call me back"),
    ]


# --- rewrite by a model --------------------------------------------------------------------------

POLISHED = """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"
[[routes.steps]]
name = "draft"
kind = "generate"
[[routes.steps]]
name = "polish"
kind = "rewrite"
adapter = "editor"
"""


async def test_a_model_rewrite_awaits_the_draft_and_streams_its_own_answer(autojump_clock):
    app, log = chain_app(POLISHED)
    t0 = trio.current_time()
    r = await post(app, typed("echo: rates are low", stream=True, stream_options={"include_usage": True}))
    assert r.status == 200
    assert r.headers["x-aiserve-steps"] == "draft,polish"
    assert r.headers["x-aiserve-deployment"] == "editor"
    assert r.text() == "Edited: rates are low"
    (_, draft), (_, polish) = log
    assert draft.messages[-1].text() == "echo: rates are low"
    assert polish.messages[1].text() == "rates are low"  # the whole draft, awaited
    # The first byte went out only after the draft was complete (10 ms + 2 x 5 ms)
    # and the editor's first token (10 ms).
    assert r.chunks[0][0] - t0 == pytest.approx(0.030)
    usage = json.loads(r.events()[-2])["usage"]
    assert usage["completion_tokens"] == count_tokens("rates are low") + count_tokens(
        "Edited: rates are low"
    )


# --- observability --------------------------------------------------------------------------------


async def test_each_step_is_a_span_under_the_inference_span(autojump_clock):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = App(make_config(MOCKS + BANK), tracer_provider=provider)  # the app's own hooks
    r = await post(app, spoken("mortgage"))
    assert r.status == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    inference = spans["inference"]
    for name in ("asr", "intent", "pick", "generate"):
        span = spans[f"step {name}"]
        assert span.parent is not None
        assert span.parent.span_id == inference.context.span_id
    # The policy rewrite runs while the answer streams: inside the generate step.
    comply = spans["step comply"].parent
    assert comply is not None
    assert comply.span_id == spans["step generate"].context.span_id
    (attempt,) = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "upstream_attempt" and (s.attributes or {}).get("aiserve.adapter") == "big"
    ]
    assert attempt.parent is not None
    assert attempt.parent.span_id == spans["step generate"].context.span_id
    request = next(s for s in exporter.get_finished_spans() if s.name.startswith("POST"))
    assert request.attributes is not None
    assert request.attributes["aiserve.steps"] == "asr,intent,pick,generate,comply"


async def test_the_step_histogram_has_a_series_per_step(autojump_clock):
    app, _ = chain_app(BANK)
    await post(app, spoken("mortgage"))
    await post(app, spoken("instalments"))
    text = app.metrics.render().decode()
    for step in ("asr", "intent", "pick", "generate", "comply"):
        assert f'aiserve_chain_step_latency_seconds_count{{route="bank",step="{step}"}} 2.0' in text
    asr = app.metrics.registry.get_sample_value(
        "aiserve_chain_step_latency_seconds_sum", {"route": "bank", "step": "asr"}
    )
    assert asr == pytest.approx(2 * 0.010)  # the mock hears after its ttft_ms


async def test_the_recording_labels_the_request_with_the_classified_intent(autojump_clock):
    app, _ = chain_app(BANK)
    outcomes: list[Outcome] = []

    class Sink:
        def offer(self, outcome: Outcome) -> None:
            outcomes.append(outcome)

    app.observer.recorder = Sink()
    await post(app, spoken("mortgage"))
    (outcome,) = outcomes
    builder = LineBuilder(
        LabelRules(default_rules(), ["intent"]),
        redactor=None,
        session_key=b"k" * 32,
        started=0.0,
        clock_start=0.0,
    )
    record = builder.record(outcome, PATH)
    assert record.labels == {"intent": "mortgage"}
    body = msgspec.json.decode(record.body)
    assert body["metadata"] == {"intent": "mortgage"}
    assert body["messages"][0]["content"][0]["type"] == "input_audio"  # replayable as sent


async def test_a_request_without_audio_skips_the_transcribe_step(autojump_clock):
    app, log = chain_app(BANK)
    r = await post(app, typed("I want a mortgage"))
    assert r.status == 200
    assert r.headers["x-aiserve-steps"] == "intent,pick,generate,comply"
    assert not any(isinstance(req, TranscriptionRequest) for _, req in log)


async def test_a_route_choice_is_for_the_next_generate_step_only(autojump_clock):
    app, log = chain_app(
        """
[[routes]]
path = "/v1/bank"
name = "bank"
adapter = "mock"
[[routes.steps]]
name = "intent"
kind = "classify"
rules = [{ label = "mortgage", pattern = "mortgage" }]
[[routes.steps]]
name = "pick"
kind = "route"
when = { mortgage = { adapter = "big" } }
[[routes.steps]]
name = "draft"
kind = "generate"
[[routes.steps]]
name = "answer"
kind = "generate"
"""
    )
    r = await post(app, typed("echo: my mortgage"))
    assert [name for name, _ in log] == ["big", "mock"]
    assert "x-aiserve-deployment" not in r.headers  # the route's own adapter streamed
    assert content(r) == "my mortgage"
