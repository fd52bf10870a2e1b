"""Deterministic embedding vectors (pure): what aiserve-sim and the mock model answer.

Each input gets a unit vector drawn from a generator seeded by a hash of the
input, so the same text always embeds the same (in every process, whatever
``--seed``), and different texts almost surely differ. A shorter
``dimensions`` takes the start of the same draw, renormalised -- the way
OpenAI's shortened embeddings relate to the full ones.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
from typing import Any

#: ``dimensions`` when the request gives none (small: the sim's vectors carry no meaning).
DEFAULT_DIMENSIONS = 8


def vector(item: str | list[int], dims: int) -> list[float]:
    """The unit vector of one input (a text or a token array)."""
    key = ("t:" + item if isinstance(item, str) else "i:" + ",".join(map(str, item))).encode()
    rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big"))
    v = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


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
