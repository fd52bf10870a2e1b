"""The semantic cache's threshold, tuned on labelled question pairs: hit rate and false hits.

    .venv/bin/python -m bench.semantic [--threshold 0.92] [--pairs bench/semantic_pairs.jsonl]
        [--url http://127.0.0.1:8080/v1/embeddings --model NAME [--api-key-env VAR]]
        [--json]

Each line of the pairs file is ``{"id", "lang", "label", "change", "a", "b"}``:
``label`` is ``paraphrase`` (b asks what a asks: it should be served a's answer) or
``near_miss`` (b asks something else: a changed number, term, amount, currency,
date, account, product, negation or party: it must never be). A pair is a hit when
b would be served a's stored answer on the same route, tenant and conversation:
the guard's facts (``cache/facts.py``) are equal and the cosine similarity of the
two questions' vectors is at or above ``--threshold``.

The vectors are the lexical ones of the mock and aiserve-sim (``util/vectors.py``) unless
``--url`` names an OpenAI-compatible embeddings endpoint (a local TEI or vLLM
server, or a gateway's ``/v1/embeddings`` route): run it on your own questions with
your own model before you choose a threshold. The report gives paraphrase hit rate
and false hits by guard and by similarity, per kind of change, the similarities of
both classes, and a sweep of thresholds. The exit status is 1 when there is a false
hit at ``--threshold``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiserve_trio.cache.facts import facts
from aiserve_trio.util.vectors import DEFAULT_DIMENSIONS, vector

PAIRS = Path(__file__).with_name("semantic_pairs.jsonl")
SWEEP = (0.80, 0.85, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98)
BUCKETS = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.92, 0.95, 0.98, 1.0)

Embed = Callable[[Sequence[str]], list[list[float]]]


@dataclass(frozen=True, slots=True)
class Scored:
    """One pair: its label and kind of change, whether the guard holds, the similarity."""

    id: str
    lang: str
    label: str
    change: str
    a: str
    b: str
    guarded: bool
    similarity: float

    def hit(self, threshold: float) -> bool:
        return not self.guarded and self.similarity >= threshold


def load(path: Path) -> list[dict[str, str]]:
    """The pairs of a JSONL file.

    Raises:
        ValueError: a line that is not a pair (naming the line).
    """
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        pair = json.loads(line)
        if pair.get("label") not in ("paraphrase", "near_miss") or not pair.get("a"):
            raise ValueError(f"{path}:{n}: not a labelled pair")
        pairs.append(pair)
    return pairs


def lexical(texts: Sequence[str]) -> list[list[float]]:
    return [vector(t, DEFAULT_DIMENSIONS) for t in texts]


def remote(url: str, model: str, key: str | None, batch: int = 64) -> Embed:
    """Embeddings from an OpenAI-compatible ``POST /v1/embeddings`` endpoint."""

    def embed(texts: Sequence[str]) -> list[list[float]]:
        out: list[list[float]] = []
        for i in range(0, len(texts), batch):
            body = json.dumps({"model": model, "input": list(texts[i : i + batch])}).encode()
            headers = {"content-type": "application/json"}
            if key:
                headers["authorization"] = f"Bearer {key}"
            req = urllib.request.Request(url, body, headers, method="POST")
            with urllib.request.urlopen(req, timeout=60) as resp:
                data = json.load(resp)["data"]
            out += [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]
        return out

    return embed


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def score(pairs: list[dict[str, str]], embed: Embed) -> list[Scored]:
    texts = sorted({t for p in pairs for t in (p["a"], p["b"])})
    vectors = dict(zip(texts, embed(texts), strict=True))
    return [
        Scored(
            p["id"],
            p.get("lang", ""),
            p["label"],
            p.get("change", ""),
            p["a"],
            p["b"],
            guarded=facts(p["a"]) != facts(p["b"]),
            similarity=cosine(vectors[p["a"]], vectors[p["b"]]),
        )
        for p in pairs
    ]


def report(scored: list[Scored], threshold: float) -> dict[str, Any]:
    """The figures the command prints (and ``--json`` writes)."""
    para = [s for s in scored if s.label == "paraphrase"]
    near = [s for s in scored if s.label == "near_miss"]
    out: dict[str, Any] = {"threshold": threshold, "pairs": len(scored)}
    out["paraphrase"] = {
        "pairs": len(para),
        "hits": sum(s.hit(threshold) for s in para),
        "hit_rate": round(sum(s.hit(threshold) for s in para) / max(len(para), 1), 4),
        "stopped_by_guard": sum(s.guarded for s in para),
        "below_threshold": sum(not s.guarded and s.similarity < threshold for s in para),
        "by_change": _by(para, threshold, "hits"),
    }
    unguarded = [s.similarity for s in near if not s.guarded]
    out["near_miss"] = {
        "pairs": len(near),
        "false_hits": sum(s.hit(threshold) for s in near),
        "stopped_by_guard": sum(s.guarded for s in near),
        "stopped_by_similarity": sum(not s.guarded and s.similarity < threshold for s in near),
        "highest_similarity_past_the_guard": round(max(unguarded), 4) if unguarded else None,
        "by_change": _by(near, threshold, "false_hits"),
        "false_hit_pairs": [
            [s.id, s.a, s.b, round(s.similarity, 4)] for s in near if s.hit(threshold)
        ],
    }
    out["similarity"] = {
        label: _histogram([s.similarity for s in scored if s.label == label])
        for label in ("paraphrase", "near_miss")
    }
    out["sweep"] = [
        {
            "threshold": t,
            "paraphrase_hit_rate": round(sum(s.hit(t) for s in para) / max(len(para), 1), 4),
            "near_miss_false_hits": sum(s.hit(t) for s in near),
            "false_hits_without_the_guard": sum(s.similarity >= t for s in near),
        }
        for t in SWEEP
    ]
    return out


def _by(items: list[Scored], threshold: float, name: str) -> dict[str, dict[str, int]]:
    groups: dict[str, list[Scored]] = defaultdict(list)
    for s in items:
        groups[f"{s.lang}:{s.change}"].append(s)
    return {
        k: {
            "pairs": len(v),
            name: sum(s.hit(threshold) for s in v),
            "stopped_by_guard": sum(s.guarded for s in v),
        }
        for k, v in sorted(groups.items())
    }


def _histogram(values: list[float]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for v in values:
        for lo, hi in itertools.pairwise(BUCKETS):
            if lo <= v < hi or (hi == 1.0 and v >= hi):
                counts[f"{lo:.2f}-{hi:.2f}"] += 1
                break
        else:
            counts[f"<{BUCKETS[0]:.2f}"] += 1
    return dict(sorted(counts.items()))


def text_report(r: dict[str, Any]) -> str:
    p, n = r["paraphrase"], r["near_miss"]
    lines = [
        f"threshold {r['threshold']}: {r['pairs']} pairs",
        f"paraphrases: {p['hits']}/{p['pairs']} hits ({p['hit_rate']:.1%}); "
        f"{p['stopped_by_guard']} stopped by the guard, {p['below_threshold']} below the threshold",
        f"near misses: {n['false_hits']} false hits of {n['pairs']}; "
        f"{n['stopped_by_guard']} stopped by the guard, "
        f"{n['stopped_by_similarity']} by similarity "
        f"(highest past the guard: {n['highest_similarity_past_the_guard']})",
        "",
        "paraphrases by change (hits / pairs, stopped by guard):",
    ]
    lines += [
        f"  {k:<22} {v['hits']:>3} / {v['pairs']:<3} guard {v['stopped_by_guard']}"
        for k, v in p["by_change"].items()
    ]
    lines.append("near misses by change (false hits / pairs, stopped by guard):")
    lines += [
        f"  {k:<22} {v['false_hits']:>3} / {v['pairs']:<3} guard {v['stopped_by_guard']}"
        for k, v in n["by_change"].items()
    ]
    lines.append("similarity (pairs per bucket):")
    for label, hist in r["similarity"].items():
        lines.append(f"  {label:<11} " + "  ".join(f"{k}: {c}" for k, c in hist.items()))
    lines.append("sweep: threshold, paraphrase hit rate, false hits, false hits without the guard")
    lines += [
        f"  {s['threshold']:.2f}  {s['paraphrase_hit_rate']:.1%}  {s['near_miss_false_hits']}"
        f"  {s['false_hits_without_the_guard']}"
        for s in r["sweep"]
    ]
    for pid, a, b, sim in n["false_hit_pairs"]:
        lines.append(f"FALSE HIT {pid} ({sim}): {a!r} -> {b!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.semantic", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--threshold", type=float, default=0.92)
    ap.add_argument("--pairs", type=Path, default=PAIRS)
    ap.add_argument("--url", help="an OpenAI-compatible embeddings endpoint (default: lexical)")
    ap.add_argument("--model", default="", help="the embedding model (with --url)")
    ap.add_argument("--api-key-env", help="the environment variable holding its API key")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if args.url and not args.model:
        ap.error("--url needs --model")
    embed: Embed = lexical
    if args.url:
        key = os.environ.get(args.api_key_env) if args.api_key_env else None
        embed = remote(args.url, args.model, key)
    r = report(score(load(args.pairs), embed), args.threshold)
    print(json.dumps(r, ensure_ascii=False, indent=1) if args.json else text_report(r))
    return 1 if r["near_miss"]["false_hits"] else 0


if __name__ == "__main__":
    sys.exit(main())
