"""``[record]``: what is recorded, where, and the label rules; validated at load.

::

    [record]
    enabled = true
    path = "recordings"          # a directory, relative to the config file
    rotate_bytes = 67108864      # a new file past this size ...
    rotate_s = 3600              # ... or this age
    keep_bytes = 10737418240     # the directory's files past this total (10 GiB) ...
    keep_s = 1209600             # ... or older than this (14 days) are deleted, oldest
                                 # first, never one a worker may still write (0: no bound)
    sample = 0.1                 # fraction of requests recorded
    routes = ["/v1/chat/completions"]   # default: every chat route and /mcp
    redact = true                # see below
    buffer = 1024                # records queued for the writer; beyond, dropped

    [[record.labels]]            # replaces the three default rules below
    label = "intent"
    value = "sql"
    keywords = ["SELECT", "JOIN"]

A rule sets ``label = value`` (``value`` defaults to ``"true"``: a flag) when
every test it has holds: ``keywords`` (any of them as a whole word) or
``regex`` (searched) in the last user message or, with ``scope = "messages"``,
in every message; ``chars_above`` (the messages' text is longer); ``fields``
(any of these top-level fields is in the body). The first rule that sets a
label wins. ``metadata_labels`` names keys of the request's ``metadata`` taken
as labels as they are (a chain's ``classify`` step writes its label there);
they win over the rules, being the request's classified meaning.

``redact``: a route without an input-side ``gdpr-redact`` policy is still
recorded redacted, by the default ``gdpr-redact`` detectors, unless
``redact = false`` is written; the string values of the body's other fields
(``metadata``, ``user``...) go through the same detectors, as no route policy
looks at them.

Leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Literal

import msgspec

from ..core.decoding import field_error

#: Label names: the alphabet of Prometheus label values (and of ``--weights``).
LABEL_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
#: Label values: no space, and none of the separators of ``--weights`` (``, : =``).
LABEL_VALUE_RE = re.compile(r"^[^\s,:=]{1,64}$")
#: A flag label's value (``has_tools``): ``--weights has_tools:4`` matches its presence.
FLAG = "true"


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Like the config's sections: an unknown key is an error."""


class LabelRule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One ``[[record.labels]]`` table (see the module docstring)."""

    label: str
    value: str = FLAG
    #: Whole words, any of which must appear.
    keywords: list[str] = msgspec.field(default_factory=list)
    #: A regular expression that must be found.
    regex: str | None = None
    #: For ``keywords`` and ``regex``.
    ignore_case: bool = False
    #: Where ``keywords`` and ``regex`` look: the last user message or every message.
    scope: Literal["last_user", "messages"] = "last_user"
    #: The characters of every message's text must exceed this.
    chars_above: int | None = None
    #: Any of these top-level body fields must be present.
    fields: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if not LABEL_NAME_RE.match(self.label):
            raise field_error("label", f"must match {LABEL_NAME_RE.pattern}, got {self.label!r}")
        if not LABEL_VALUE_RE.match(self.value):
            why = f"1-64 characters without spaces, ',', ':' or '=', got {self.value!r}"
            raise field_error("value", why)
        if not (self.keywords or self.regex or self.chars_above is not None or self.fields):
            raise ValueError("a rule needs a test: `keywords`, `regex`, `chars_above` or `fields`")
        for i, word in enumerate(self.keywords):
            if not word.strip():
                raise field_error(f"keywords[{i}]", "must not be empty")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise field_error("regex", f"not a regular expression: {exc}") from None
        if self.chars_above is not None and self.chars_above < 0:
            raise field_error("chars_above", "must not be negative")


def default_rules() -> list[LabelRule]:
    """The design's three classes: SQL intent, long prompts, tool use."""
    return [
        # Upper case only: "select" and "join" are everyday words in a bank's chat;
        # SQL pasted into a prompt is nearly always written in capitals.
        LabelRule(label="intent", value="sql", keywords=["SELECT", "JOIN"]),
        LabelRule(label="complexity", value="high", chars_above=1500),
        LabelRule(label="has_tools", fields=["tools", "tool_choice"]),
    ]


class RecordConfig(_Section):
    """``[record]`` (off unless ``enabled = true``)."""

    enabled: bool = False
    #: The directory the files go to (relative: to the config file's folder).
    path: str = "recordings"
    rotate_bytes: int = 64 * 1024 * 1024
    rotate_s: float = 3600.0
    #: The recording files of the directory (every worker's) are deleted, oldest first,
    #: while together they are larger than this (0: no bound). Issue 55: rotation opened
    #: new files and nothing ever removed the old ones.
    keep_bytes: int = 10 * 1024**3
    #: ... and once their last line is older than this (0: kept however old).
    keep_s: float = 14 * 86_400.0
    #: Fraction of the requests recorded, 0..1.
    sample: float = 1.0
    #: Route paths recorded (``/mcp``: its tool calls); empty: every chat route and ``/mcp``.
    routes: list[str] = msgspec.field(default_factory=list)
    #: False only when written: the recording then keeps what the route let through.
    redact: bool = True
    #: Record requests ``aiserve-replay`` sent (marked ``X-Aiserve-Replay``); by default
    #: they are left out (and counted), so a replay never records itself.
    include_replays: bool = False
    #: Records queued for the writer; a record that finds the queue full is dropped.
    buffer: int = 1024
    labels: list[LabelRule] = msgspec.field(default_factory=default_rules)
    #: ``metadata`` keys whose values are taken as labels.
    metadata_labels: list[str] = msgspec.field(default_factory=lambda: ["intent"])
    #: Environment variable with the key session ids are hashed with (HMAC-SHA256);
    #: unset: a random key per worker (hashes then match within one worker only).
    session_key_env: str = "AISERVE_RECORD_KEY"

    def __post_init__(self) -> None:
        if not self.path:
            raise field_error("path", "must name a directory")
        for key in ("rotate_bytes", "rotate_s", "buffer"):
            if getattr(self, key) <= 0:
                raise field_error(key, "must be positive")
        for key in ("keep_bytes", "keep_s"):
            if getattr(self, key) < 0:
                raise field_error(key, "must not be negative (0: no bound)")
        if not 0.0 <= self.sample <= 1.0:
            raise field_error("sample", f"must be between 0 and 1, got {self.sample}")
        for i, name in enumerate(self.metadata_labels):
            if not LABEL_NAME_RE.match(name):
                why = f"must match {LABEL_NAME_RE.pattern}, got {name!r}"
                raise field_error(f"metadata_labels[{i}]", why)


def check_record(chat: Collection[str], record: RecordConfig) -> tuple[str, str] | None:
    """What is wrong between ``[record]`` and the routes: (the TOML key, why), or None.

    Args:
        chat: the paths of the config's chat routes.
    """
    for i, path in enumerate(record.routes):
        if path not in chat and path != "/mcp":  # /mcp: its tool calls
            known = ", ".join(sorted(chat)) or "none"
            return f"record.routes[{i}]", f"no chat route serves {path!r} (chat routes: {known})"
    return None
