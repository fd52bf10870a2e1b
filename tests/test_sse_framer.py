"""The SSE framer and the output-filter chaining, without I/O."""

import json
from typing import Any

from aiserve_trio.core.api import Usage
from aiserve_trio.core.errors import StageDeadlineExceeded
from aiserve_trio.http.sse import DONE
from aiserve_trio.http.sse import ChatFramer as SSEFramer
from aiserve_trio.policies.base import OutputFilter, apply_filters, finish_filters


def parse(event: bytes) -> tuple[str, dict[str, Any]]:
    text = event.decode()
    assert text.endswith("\n\n")
    id_line, data_line = text.strip("\n").split("\n")
    assert id_line.startswith("id: ")
    assert data_line.startswith("data: ")
    data: dict[str, Any] = json.loads(data_line[6:])
    return id_line[4:], data


def test_events_are_numbered_and_shaped_like_openai_chunks():
    f = SSEFramer("chatcmpl-1", "m", 123)
    evs = [
        f.role(),
        f.content('héllo "x"\n'),
        f.finish("stop"),
        f.usage(Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)),
    ]
    parsed = [parse(e) for e in evs]
    assert [i for i, _ in parsed] == ["0", "1", "2", "3"]
    role, content, finish, usage = (p for _, p in parsed)
    assert role == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ],
    }
    assert content["choices"][0]["delta"] == {"content": 'héllo "x"\n'}
    assert finish["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert usage["choices"] == []
    assert usage["usage"]["total_tokens"] == 5


def test_error_event_carries_the_envelope_and_continues_the_numbering():
    f = SSEFramer("c", "m", 0)
    f.role()
    i, body = parse(f.error(StageDeadlineExceeded("sse")))
    assert i == "1"
    assert body == {
        "error": {
            "message": "the sse stage did not finish within its deadline budget",
            "type": "timeout",
            "param": "sse",
            "code": "stage_deadline_exceeded",
        }
    }
    assert DONE == b"data: [DONE]\n\n"


class HoldLastChar:
    """A filter that holds back one character (the shape of a real redactor's tail)."""

    max_holdback = 1

    def __init__(self, tag: str) -> None:
        self.tail = ""
        self.tag = tag

    def feed(self, text: str) -> str:
        text = self.tail + text
        self.tail = text[-1:]
        return text[:-1].replace("a", self.tag)

    def finish(self) -> str:
        out, self.tail = self.tail.replace("a", self.tag), ""
        return out


def test_filters_chain_in_order_and_finish_flushes_every_tail():
    filters: list[OutputFilter] = [HoldLastChar("b"), HoldLastChar("c")]
    out = "".join(apply_filters(filters, piece) for piece in ["aa", "xa", "a"])
    out += finish_filters(filters)
    # the first filter turns every a into b; nothing reaches the second as a
    assert out == "bbxbb"
