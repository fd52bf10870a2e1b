"""Write bench/recordings/sample.jsonl: a synthetic recording across the design's classes.

Deterministic (``--seed``): the same file every time, so it is checked in and a
change to it shows in review. What it models is a bank's chat traffic as the
gateway would have recorded it (``aiserve_trio/record/schema.py``):

- plain questions, short replies (about half);
- ``intent=sql``: an analyst pasting SQL (SELECT ... JOIN ...), longer replies;
- ``complexity=high``: a statement or a contract pasted in, over 1,500 characters;
- ``has_tools``: an agent offering functions (``tools``, ``tool_choice``);
- some of them together, a few non-streamed, a few refused by a policy (no body);
- arrivals as a Poisson process (``--rate`` per second) over several channels;
  a third continue a short conversation (hashed session id); some set a timeout.

The labels are computed by the gateway's own default rules, so the file is what
``[record]`` would have written. The outcomes are invented (plausible numbers,
not measurements): replay ignores them.

    .venv/bin/python -m bench.make_sample_recording            # the checked-in file
    .venv/bin/python -m bench.make_sample_recording --count 2000 --out /tmp/big.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from aiserve_trio.record.labels import LabelRules  # noqa: E402
from aiserve_trio.record.schema import NO_BODY, Record, RecordedOutcome, encoder  # noqa: E402
from aiserve_trio.record.settings import default_rules  # noqa: E402

OUT = ROOT / "bench" / "recordings" / "sample.jsonl"
#: What the checked-in file was made with (tests/test_replay.py makes it again).
COUNT, RATE, SEED = 400, 20.0, 19
MODEL = "sim-model"
#: 2026-11-30T00:00:00Z: a fixed start, so the file does not change with the clock.
STARTED = 1_796_083_200.0

QUESTIONS = [
    "What is the annual fee of my credit card?",
    "How do I raise my card limit?",
    "Can I pay my instalment early without a penalty?",
    "Where is the nearest branch open on Saturday?",
    "Why was my payment declined yesterday?",
    "How long does a transfer abroad take?",
    "What documents do I need for a mortgage?",
    "How do I report a lost card?",
    "Explain the difference between APR and the interest rate.",
    "Can I split last month's purchases into 12 instalments?",
]
TABLES = ["cards", "transactions", "customers", "branches", "loans", "instalments"]
CLAUSE = (
    "The Borrower shall repay the Principal in equal monthly instalments on the "
    "due date stated in Schedule 1; late payment accrues interest at the default "
    "rate from the due date until the date of actual payment. "
)
STATEMENT_LINE = "{d:02d}/11 POS {merchant:<24} {amount:>9.2f} CNY\n"
MERCHANTS = ["Metro Supermarket", "Air China", "Didi Rides", "Starbucks", "JD.com", "Shell"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_balance",
            "description": "Current balance of one of the customer's accounts",
            "parameters": {
                "type": "object",
                "properties": {"account": {"type": "string"}},
                "required": ["account"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_instalment_plan",
            "description": "Split a purchase into monthly instalments",
            "parameters": {
                "type": "object",
                "properties": {
                    "transaction_id": {"type": "string"},
                    "months": {"type": "integer", "enum": [3, 6, 12, 24]},
                },
                "required": ["transaction_id", "months"],
            },
        },
    },
]
CHANNELS = ["app", "app", "app", "web", "web", "wechat", "api"]


def sql(rng: random.Random) -> str:
    a, b = rng.sample(TABLES, 2)
    return (
        f"Why is this query slow?\nSELECT {a}.id, SUM({b}.amount) FROM {a} "
        f"JOIN {b} ON {b}.{a[:-1]}_id = {a}.id WHERE {b}.created_at > now() - interval "
        f"'{rng.randint(7, 90)} days' GROUP BY {a}.id ORDER BY 2 DESC LIMIT {rng.randint(10, 100)};"
    )


def long_text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        body = CLAUSE * rng.randint(9, 16)
        return "Summarise the obligations in this contract:\n" + body
    lines = "".join(
        STATEMENT_LINE.format(
            d=rng.randint(1, 30), merchant=rng.choice(MERCHANTS), amount=rng.uniform(5, 3000)
        )
        for _ in range(rng.randint(30, 60))
    )
    return "Which of these purchases can be split into instalments?\n" + lines


def body(kind: set[str], rng: random.Random) -> dict[str, Any]:
    """A request of the classes in ``kind`` (any of sql, high, tools)."""
    parts = []
    if "high" in kind:
        parts.append(long_text(rng))
    parts.append(sql(rng) if "sql" in kind else rng.choice(QUESTIONS))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are the bank's assistant. Be brief and exact."},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
    out: dict[str, Any] = {"model": MODEL, "messages": messages, "stream": rng.random() > 0.1}
    # Reply length by class: the sim answers exactly max_tokens tokens.
    if "sql" in kind:
        out["max_tokens"] = rng.randint(120, 200)
    elif "high" in kind:
        out["max_tokens"] = rng.randint(60, 120)
    else:
        out["max_tokens"] = rng.randint(24, 80)
    if "tools" in kind:
        out["tools"] = TOOLS
        out["tool_choice"] = "auto"
        out["max_tokens"] = rng.randint(20, 40)
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


def pick_kind(rng: random.Random) -> set[str]:
    """The class mix: about half plain; the rest SQL, long, tools, and some overlap."""
    kind = set()
    if rng.random() < 0.18:
        kind.add("sql")
    if rng.random() < 0.16:
        kind.add("high")
    if rng.random() < 0.15:
        kind.add("tools")
    return kind


def outcome(kind: set[str], b: dict[str, Any], rng: random.Random) -> RecordedOutcome:
    chars = sum(len(m["content"]) for m in b["messages"])
    ttft = 25 + chars / 4 * 0.2 + rng.uniform(0, 15)
    total = ttft + b["max_tokens"] * rng.uniform(9, 12)
    return RecordedOutcome(
        status="ok",
        total_ms=round(total, 3),
        ttft_ms=round(ttft, 3),
        prompt_tokens=chars // 4,
        completion_tokens=b["max_tokens"],
        finish_reason="tool_calls" if "tools" in kind and rng.random() < 0.7 else "length",
    )


def generate(count: int, rate: float, seed: int) -> list[Record]:
    rng = random.Random(seed)
    rules = LabelRules(default_rules(), ["intent"])
    # A third of the requests continue a conversation, two or three turns long: enough
    # for a replay to build some history on the target, not so much that a plain
    # question inherits a pasted contract from an unrelated earlier turn.
    sessions = [hashlib.sha256(f"s{i}".encode()).hexdigest()[:32] for i in range(count // 8)]
    out = []
    t = 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        headers = {"x-channel": rng.choice(CHANNELS)}
        if rng.random() < 1 / 3:
            headers["x-session-id"] = rng.choice(sessions)
        if rng.random() < 0.2:
            headers["x-request-timeout-ms"] = str(rng.choice([8000, 15000, 30000]))
        if rng.random() < 0.01:  # refused by an input policy: no body to replay
            out.append(
                Record(
                    started=STARTED,
                    offset=round(t, 6),
                    route="/v1/chat/completions",
                    body=NO_BODY,
                    headers=headers,
                    outcome=RecordedOutcome(status="forbidden", total_ms=1.2, error="anti-fraud-v2"),
                )
            )
            continue
        kind = pick_kind(rng)
        b = body(kind, rng)
        raw = msgspec.json.encode(b)
        out.append(
            Record(
                started=STARTED,
                offset=round(t, 6),
                route="/v1/chat/completions",
                body=msgspec.Raw(raw),
                headers=headers,
                labels=rules.labels(b),
                outcome=outcome(kind, b, rng),
            )
        )
    return out


def as_lines(records: list[Record]) -> bytes:
    return b"".join(encoder.encode(r) + b"\n" for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=COUNT)
    ap.add_argument("--rate", type=float, default=RATE, help="mean arrivals per second")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    records = generate(args.count, args.rate, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(as_lines(records))
    counts: dict[str, int] = {}
    for r in records:
        for k, v in r.labels.items():
            counts[f"{k}={v}"] = counts.get(f"{k}={v}", 0) + 1
    span = records[-1].offset - records[0].offset
    print(f"{args.out}: {len(records)} records over {span:.1f} s; labels {counts}")


if __name__ == "__main__":
    main()
