"""Lexical embedding vectors (pure): what aiserve-sim and the mock model answer.

No model: a text's vector is its hashed word and character n-grams, so texts
that share their words are near and the same text always embeds the same (in
every process, whatever ``--seed``). Before the n-grams are taken the text is
normalised -- Unicode compatibility forms (full-width letters and digits become
ASCII), case folded, every punctuation mark and symbol a space -- so case,
punctuation, width and spacing do not move a vector, and ``20-year`` embeds as
``20 year``. Han, kana and Hangul characters are words of their own (those
scripts do not separate words with spaces).

The features, each hashed (BLAKE2b) to a bucket of ``dims`` with a sign:
words, pairs of adjacent words, and the character trigrams of words of other
scripts (so ``fee`` and ``fees`` are near). A token array's tokens are words.
This is for tests and benchmarks; a real deployment embeds with a real model.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import struct
import unicodedata
from typing import Any

#: ``dimensions`` when the request gives none: enough buckets that unrelated
#: texts of a few dozen words rarely share one.
DEFAULT_DIMENSIONS = 512
#: Inputs longer than this in all (characters) are embedded in a worker thread by the
#: mock and aiserve-sim: about 10 ms of hashing, the most a request may hold the loop.
INLINE_CHARS = 8_192
#: Weights: words and word pairs carry the meaning; trigrams smooth inflections.
_WORD = 1.0
_PAIR = 1.0
_TRIGRAM = 0.25


def _is_ideograph(ch: str) -> bool:
    o = ord(ch)
    return (
        0x3040 <= o <= 0x30FF  # kana
        or 0x3400 <= o <= 0x9FFF  # CJK unified (and extension A)
        or 0xAC00 <= o <= 0xD7AF  # Hangul syllables
        or 0xF900 <= o <= 0xFAFF
        or 0x20000 <= o <= 0x2FFFF
    )


def normalise(text: str) -> str:
    """``text`` as the vector sees it: NFKC, case folded, punctuation and symbols as spaces
    (but ``5,000`` is ``5000`` and ``3.5`` one number), runs of spaces as one."""
    s = unicodedata.normalize("NFKC", text).casefold()
    out = []
    for i, ch in enumerate(s):
        if unicodedata.category(ch)[0] in "LN":
            out.append(ch)
        elif ch in ",." and 0 < i < len(s) - 1 and s[i - 1].isdigit() and s[i + 1].isdigit():
            out.append("." if ch == "." else "")  # 5,000 is 5000; 3.5 stays one number
        else:
            out.append(" ")
    return " ".join("".join(out).split())


def words(text: str) -> list[str]:
    """The words of ``text`` after :func:`normalise`: runs of letters and digits, each
    Han, kana or Hangul character a word of its own."""
    out: list[str] = []
    for chunk in normalise(text).split():
        run = ""
        for ch in chunk:
            if _is_ideograph(ch):
                if run:
                    out.append(run)
                    run = ""
                out.append(ch)
            else:
                run += ch
        if run:
            out.append(run)
    return out


def _features(item: str | list[int]) -> list[tuple[str, float]]:
    toks = words(item) if isinstance(item, str) else [f"#{t}" for t in item]
    feats = [("w:" + t, _WORD) for t in toks]
    feats += [(f"p:{a} {b}", _PAIR) for a, b in itertools.pairwise(toks)]
    for t in toks:
        if len(t) > 3 and not _is_ideograph(t[0]) and not t.startswith("#"):
            padded = f"<{t}>"
            feats += [("c:" + padded[i : i + 3], _TRIGRAM) for i in range(len(padded) - 2)]
    return feats


def vector(item: str | list[int], dims: int) -> list[float]:
    """The unit vector of one input (a text or a token array); all zeros for a text
    with no letters or digits."""
    v = [0.0] * dims
    for feat, weight in _features(item):
        h = int.from_bytes(hashlib.blake2b(feat.encode(), digest_size=8).digest(), "big")
        v[(h >> 1) % dims] += weight if h & 1 else -weight
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm else v


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (0.0 when either is all zeros)."""
    dot = sum(x * y for x, y in zip(a, b, strict=False))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def encode_base64(v: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32, base64."""
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()


def embeddings_body(
    model: str,
    inputs: list[str | list[int]],
    tokens: list[int],
    dims: int,
    encoding_format: str,
) -> dict[str, Any]:
    """The response body: one ``embedding`` object per input, in order, and ``usage``."""
    data = []
    for i, item in enumerate(inputs):
        v = vector(item, dims)
        emb: list[float] | str = encode_base64(v) if encoding_format == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(tokens)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


def heavy(inputs: list[str | list[int]]) -> bool:
    """Whether embedding ``inputs`` would hold an event loop too long (see :data:`INLINE_CHARS`)."""
    return sum(len(x) for x in inputs) > INLINE_CHARS


def embedding_inputs(raw: str | list[Any]) -> list[str | list[int]]:
    """``input`` as a list of texts or token arrays.

    Raises:
        ValueError: empty, or not a string, a list of strings, a token array or
            a list of token arrays.
    """
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise ValueError("`input` must not be empty")
    if all(_is_int(x) for x in raw):
        return [list(raw)]
    out: list[str | list[int]] = []
    for x in raw:
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, list) and x and all(_is_int(t) for t in x):
            out.append(list(x))
        else:
            raise ValueError(
                "`input` must be a string, a list of strings, a token array or a list of them"
            )
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
