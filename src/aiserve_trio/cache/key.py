"""The cache key: a hash of everything that changes the answer, and nothing else (pure).

What goes in (see :func:`request_key`), all taken from the request as it goes
upstream (the context stage's :class:`~aiserve_trio.adapters.base.InferenceRequest`,
after session context, input policies and fitting to the window):

- the tenant: one tenant never sees another's entries;
- the route, its policies and their version (:func:`policy_version`: names,
  kinds, typed settings, rule-pack bytes), and the channel when the route has
  policies (a policy may answer each channel differently): the stored reply is
  the one *after* the output policies;
- the adapter and its configuration (:func:`adapter_version`: base URL,
  ``upstream_model``, mock rules...): the model after mapping;
- the model the client named, every message as it goes upstream with every
  content part, the gateway's token limit, and the session variables the
  adapter sees (the mock answers from them);
- every other top-level field the client sent (``tools``, ``tool_choice``,
  ``response_format``, ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``max_tokens``, penalties, ``logit_bias``, ``n``, fields unknown today...),
  except those that only say how or to whom the answer is delivered:
  :data:`NOT_IN_KEY`.

Canonical means JSON meaning, not bytes: objects re-encoded with sorted keys and
no whitespace, string escapes decoded, and numbers by value (``1``, ``1.0`` and
``1e0`` are one number; ``1e400`` stays a number, never ``null``).
"""

from __future__ import annotations

import decimal
import hashlib
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import msgspec

from ..core.errors import BadRequest
from ..core.slices import ITEM_UNITS, Meter, Steps, finish

#: Changes when what the key covers or how an entry is encoded changes.
KEY_VERSION = 1
#: Top-level fields that do not change the answer: how it is delivered
#: (a streamed and a non-streamed request share it) and who asked.
NOT_IN_KEY = frozenset({"stream", "stream_options", "user", "metadata"})
_INT_RANGE = 2**63
#: Exact arithmetic over any exponent a JSON literal can carry (``1e1000000``):
#: the default context would overflow, or round a long mantissa.
_EXACT = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)


def _number(text: str) -> int | Decimal:
    """A JSON non-integer literal by its value: integral values as ints, others exact."""
    d = Decimal(text)
    # adjusted() first: an integral test of 1e1000000 would build a million digits.
    if d.adjusted() < 19 and d == d.to_integral_value(context=_EXACT) and abs(d) < _INT_RANGE:
        return int(d)
    return d.normalize(context=_EXACT)


_decode = msgspec.json.Decoder(float_hook=_number).decode
_encode = msgspec.json.Encoder(order="sorted", decimal_format="number").encode


def canonical(raw: bytes | msgspec.Raw) -> Any:
    """The JSON value of ``raw`` with numbers by value (encode it with :func:`canonical_bytes`).

    Raises:
        msgspec.DecodeError: ``raw`` is not JSON (the parse stage has refused such bodies).
        BadRequest: ``invalid_json`` -- an integer literal longer than Python
            converts (``sys.get_int_max_str_digits()``, 4,300 digits by default).
    """
    try:
        return _decode(raw)
    except msgspec.ValidationError:  # the only one an untyped decode raises: int too long
        limit = sys.get_int_max_str_digits()
        raise BadRequest(
            f"the request holds an integer with more than {limit} digits, the limit",
            code="invalid_json",
        ) from None


#: A JSON text longer than this is made canonical a level at a time (in steps).
CANONICAL_PIECE = 65_536
#: Bytes of JSON decoded and encoded again per work unit (~1-5 ns a byte; a unit ~5 us).
BYTES_PER_UNIT = 64
_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_array = msgspec.json.Decoder(list[msgspec.Raw])


def canonical_steps(
    raw: bytes | msgspec.Raw, meter: Meter, write: Callable[[bytes], object]
) -> Steps[None]:
    """``canonical_bytes(canonical(raw))`` -- the same bytes -- written to ``write``
    piece by piece, in steps.

    A decode and an encode are one call each: a tool's schema of 24,000 properties
    (within every limit) took 13 ms in one piece. A long object or array is split a
    level at a time (its raw pieces: ~0.1 us each) and written as the sorted encoder
    would write it: keys in code point order, no whitespace. Written, not joined:
    joining megabytes again at each level is a long step of its own.

    Raises:
        BadRequest: as :func:`canonical`.
    """
    head = bytes(memoryview(raw)[:1])
    if len(raw) <= CANONICAL_PIECE or head not in (b"{", b"["):
        write(_encode(canonical(raw)))
        if meter.charge(ITEM_UNITS + len(raw) // BYTES_PER_UNIT):
            yield
        return
    if head == b"{":
        pieces = _raw_object.decode(raw)
        if meter.items(len(pieces)):
            yield
        write(b"{")
        for i, key in enumerate(sorted(pieces)):
            write((b"," if i else b"") + _encode(key) + b":")
            yield from canonical_steps(pieces[key], meter, write)
        write(b"}")
        return
    items = _raw_array.decode(raw)
    if meter.items(len(items)):
        yield
    write(b"[")
    for i, piece in enumerate(items):
        if i:
            write(b",")
        yield from canonical_steps(piece, meter, write)
    write(b"]")


def canonical_bytes(value: Any) -> bytes:
    """``value`` as JSON with sorted keys and no whitespace."""
    return _encode(value)


def fingerprint(value: Any) -> str:
    """A short stable hash of a JSON-encodable value (configs, settings)."""
    return hashlib.blake2b(_encode(value), digest_size=16).hexdigest()


def policy_version(specs: Iterable[tuple[str, str, Any, bytes]]) -> str:
    """The version of a route's policies: their names, kinds, settings and rule packs.

    Args:
        specs: per policy in route order, ``(name, kind, settings, pack bytes)``;
            settings are anything msgspec encodes (the typed settings Struct).
    """
    h = hashlib.blake2b(digest_size=16)
    for name, kind, settings, pack in specs:
        h.update(_encode([name, kind, msgspec.to_builtins(settings, order="sorted")]))
        h.update(hashlib.blake2b(pack, digest_size=16).digest())
    return h.hexdigest()


def adapter_version(name: str, config: Any) -> str:
    """The version of an adapter: its name and every setting (a changed backend, model
    mapping or mock rule is a different model)."""
    return fingerprint([name, msgspec.to_builtins(config, order="sorted")])


@dataclass(frozen=True, slots=True)
class RouteScope:
    """The parts of a key fixed per route when the app starts."""

    #: The route's path (its policies and caps are the route's).
    route: str
    adapter: str
    adapter_version: str
    policy_version: str
    #: The route has policies: the channel is part of the key.
    per_channel: bool


def request_key(
    scope: RouteScope,
    *,
    tenant: str,
    channel: str,
    model: str,
    messages: Iterable[bytes | msgspec.Raw],
    fields: Mapping[str, bytes | msgspec.Raw],
    max_tokens: int | None,
    variables: Mapping[str, str],
) -> str:
    """The key of one request (64 hex digits of BLAKE2b-256).

    Args:
        messages: each message's JSON as it goes upstream.
        fields: the client's other top-level fields, raw; :data:`NOT_IN_KEY` are left out.
        max_tokens: the limit the gateway sends (the route's cap applied).
    """
    return finish(
        request_key_steps(
            scope,
            tenant=tenant,
            channel=channel,
            model=model,
            messages=messages,
            fields=fields,
            max_tokens=max_tokens,
            variables=variables,
        )
    )


def request_key_steps(
    scope: RouteScope,
    *,
    tenant: str,
    channel: str,
    model: str,
    messages: Iterable[bytes | msgspec.Raw],
    fields: Mapping[str, bytes | msgspec.Raw],
    max_tokens: int | None,
    variables: Mapping[str, str],
) -> Steps[str]:
    """:func:`request_key` in steps (the cache service runs them sliced).

    The material is hashed as it is made, piece by piece, in the bytes one
    encode of the whole would give::

        [KEY_VERSION, *who, [message, ...], {field: value, ...}, max_tokens, variables]

    so a key is the same whichever way it was computed.
    """
    meter = Meter()
    h = hashlib.blake2b(digest_size=32)
    head = _encode([KEY_VERSION, *_who(scope, tenant, channel, model)])
    h.update(head[:-1] + b",[")
    for i, m in enumerate(messages):
        if i:
            h.update(b",")
        yield from canonical_steps(m, meter, h.update)
    h.update(b"],{")
    for i, key in enumerate(sorted(k for k in fields if k not in NOT_IN_KEY)):
        if i:
            h.update(b",")
        h.update(_encode(key) + b":")
        yield from canonical_steps(fields[key], meter, h.update)
    h.update(b"}," + _encode(max_tokens) + b"," + _encode(dict(variables)) + b"]")
    return h.hexdigest()


def _who(scope: RouteScope, tenant: str, channel: str, model: str) -> list[Any]:
    """Who asks which model behind what: the start of every key's material."""
    return [
        tenant,
        scope.route,
        channel if scope.per_channel else None,
        scope.adapter,
        scope.adapter_version,
        scope.policy_version,
        model,
    ]


def _asked(
    fields: Mapping[str, bytes | msgspec.Raw], max_tokens: int | None, variables: Mapping[str, str]
) -> list[Any]:
    """How it is asked: every other field, the token limit, the session variables."""
    return [
        {k: canonical(v) for k, v in fields.items() if k not in NOT_IN_KEY},
        max_tokens,
        dict(variables),
    ]


def semantic_guard(
    scope: RouteScope,
    *,
    tenant: str,
    channel: str,
    model: str,
    earlier: Iterable[bytes | msgspec.Raw],
    last: Mapping[str, Any],
    facts: Iterable[str],
    fields: Mapping[str, bytes | msgspec.Raw],
    max_tokens: int | None,
    variables: Mapping[str, str],
    embedder: tuple[str, str],
) -> str:
    """The guard of a semantic lookup: :func:`request_key`'s material with the last
    user message's wording left out -- its other fields (``last``) and its ``facts``
    stay -- and the embedder (adapter, model) in: vectors of two
    models are not comparable. Two questions share an answer only under one guard.
    """
    material = [
        KEY_VERSION,
        "semantic",
        *_who(scope, tenant, channel, model),
        [canonical(m) for m in earlier],
        dict(last),
        sorted(facts),
        *_asked(fields, max_tokens, variables),
        list(embedder),
    ]
    return hashlib.blake2b(_encode(material), digest_size=32).hexdigest()


# --- what a request may do with the cache -----------------------------------------


class Directives(msgspec.Struct, frozen=True):
    """The client's ``Cache-Control`` request directives that the cache honours."""

    #: ``no-cache``: do not answer from the cache (a fresh answer is stored).
    no_cache: bool = False
    #: ``no-store``: neither answer from the cache nor store the answer.
    no_store: bool = False


NO_DIRECTIVES = Directives()


def directives(header: str | None) -> Directives:
    """Parse a ``Cache-Control`` request header (unknown directives are ignored)."""
    if not header:
        return NO_DIRECTIVES
    names = {part.split("=", 1)[0].strip().lower() for part in header.split(",")}
    return Directives(no_cache="no-cache" in names, no_store="no-store" in names)


def deterministic(temperature: float | None, seed: bytes | msgspec.Raw | None) -> bool:
    """Whether a request asks for a repeatable answer: ``temperature`` 0 or a ``seed``."""
    if temperature == 0:
        return True
    return seed is not None and bytes(seed).strip() != b"null"
