"""CPU per request of reading a chat body and building the upstream one (no I/O).

    .venv/bin/python -m bench.parse_cost

What the gateway pays for relaying everything a client sends: the typed decode of
the fields it acts on, the raw top-level fields, each message kept with its own
JSON, and the upstream body rebuilt from them -- against a bare typed decode and
re-encode of a fixed struct (what the gateway did before it kept the raw body).
"""

from __future__ import annotations

import json
import time

import msgspec

from aiserve_trio.adapters.base import InferenceRequest
from aiserve_trio.adapters.wire import chat_body
from aiserve_trio.config import LimitsConfig
from aiserve_trio.stages.parse import decode_request

BODY = json.dumps(
    {
        "model": "sim-model",
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "hello there, how are you?"},
        ],
        "temperature": 0.7,
    }
).encode()


class _Msg(msgspec.Struct):
    role: str
    content: str


class _Body(msgspec.Struct):
    model: str
    messages: list[_Msg]
    stream: bool = False
    temperature: float | None = None


def per_call_us(fn: object, n: int) -> float:
    assert callable(fn)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


def main(n: int = 20_000) -> None:
    limits = LimitsConfig()
    parsed = decode_request(BODY, limits, None)
    req = InferenceRequest(
        request_id="r", model="m", messages=parsed.messages, deadline=1.0, extra=parsed.extra
    )
    dec, enc = msgspec.json.Decoder(_Body), msgspec.json.Encoder()
    fixed = dec.decode(BODY)
    rows = {
        "decode_request (typed fields + raw body + messages)": per_call_us(
            lambda: decode_request(BODY, limits, None), n
        ),
        "chat_body (the upstream body)": per_call_us(lambda: chat_body(req, "m"), n),
        "bare typed decode of a fixed struct": per_call_us(lambda: dec.decode(BODY), n),
        "bare encode of it": per_call_us(lambda: enc.encode(fixed), n),
    }
    for name, us in rows.items():
        print(f"{us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
