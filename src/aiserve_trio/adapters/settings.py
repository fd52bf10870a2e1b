"""The adapters' settings: one ``[adapters.NAME]`` table per kind, and the table of kinds.

Each kind is a tagged Struct (``kind = "openai"``...); :data:`KINDS` names them by
their tag, and :data:`AdapterConfig` is their union, as the config decodes it.
``adapters/__init__.py`` builds an adapter from its settings through its own table
of kinds; the TLS files an adapter names are read by ``tls.py``.

A leaf module (msgspec and the decoding helpers): the config imports it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple

import msgspec

from ..core.decoding import Section, field_error, not_above, positive


class MockToolCall(Section):
    #: The function to call (used when the request offers a tool of that name).
    name: str
    #: Its arguments, JSON; ``{name}`` is filled like a reply (JSON-escaped).
    arguments: str = "{}"


class MockRule(Section):
    #: A regular expression searched (case-insensitively) in the last user or tool message.
    pattern: str
    #: The reply; ``{name}`` is replaced by a session variable or a named group.
    reply: str
    #: Streamed as reasoning (``reasoning_content``) before the reply, templated alike.
    reasoning: str = ""
    #: Answer with this tool call instead of the reply, when the request offers the tool.
    tool_call: MockToolCall | None = None

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise field_error("pattern", f"not a regular expression: {exc}") from None


def _models(models: list[str]) -> None:
    if not models:
        raise field_error("models", "must name at least one model")


class MockAdapterConfig(Section, tag="mock", tag_field="kind"):
    models: list[str] = msgspec.field(default_factory=lambda: ["aiserve-mock"])
    ttft_ms: float = 60.0
    inter_token_ms: float = 20.0
    rules: list[MockRule] = msgspec.field(default_factory=list)
    default_reply: str = "I am the aiserve-trio mock model."

    def __post_init__(self) -> None:
        _models(self.models)


class UpstreamTLS(Section):
    """TLS settings of an adapter that speaks HTTP to an ``https://`` backend.

    Inherit it in an adapter's config table. Certificates are always verified
    (there is no switch to turn that off); relative paths are from the config
    file's folder. The loader reads every file once (:func:`check_tls_files`):
    a file that cannot be read, or a key readable by others, is a start-up error.
    """

    #: PEM bundle of the CAs to trust instead of the system's (a private CA).
    ca_file: str | None = None
    #: PEM client certificate (mTLS), with ``client_key``.
    client_cert: str | None = None
    #: PEM private key of ``client_cert``; refused if others may read it.
    client_key: str | None = None
    #: Name sent in SNI and verified against the certificate (an IP-addressed backend).
    server_name: str | None = None
    #: Oldest TLS version accepted.
    tls_min_version: Literal["1.2", "1.3"] = "1.2"
    #: Set by the loader: a digest of the files' bytes (a changed file is a changed config).
    tls_files_digest: str = ""

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise field_error("client_key", "client_cert and client_key go together")
        if self.server_name is not None and not re.fullmatch(
            r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", self.server_name
        ):
            raise field_error("server_name", f"not a host name: {self.server_name!r}")


class OpenAIAdapterConfig(UpstreamTLS, tag="openai", tag_field="kind", kw_only=True):
    base_url: str
    models: list[str] = msgspec.field(default_factory=list)
    #: Model name sent upstream; default: the model the client asked for.
    upstream_model: str | None = None
    #: Name of the environment variable holding the upstream API key.
    api_key_env: str | None = None
    #: HTTP/2 to the backend: ALPN ``h2`` over https, prior knowledge (h2c) over http,
    #: through the lean HTTP/2 client (``adapters/h2client.py``; httpx2 with ``client =
    #: "httpx2"``). One socket per 100 streams (fewer if the backend allows fewer)
    #: instead of one per stream: what 10,000 held streams need.
    http2: bool = False
    #: Concurrent upstream streams before requests queue (HTTP/1.1: one
    #: connection each; HTTP/2: up to 100 per connection).
    max_connections: int = 4_096
    connect_timeout_ms: int = 2_000
    #: Retries before the first token (connect errors, timeouts, 429, 5xx).
    max_retries: int = 2
    backoff_base_ms: int = 100
    backoff_max_ms: int = 2_000
    context_window: int = 8_192
    #: ``cl100k_base`` or ``o200k_base``; default chosen by model family.
    tokenizer: str | None = None
    #: Extra headers sent upstream on every request.
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    #: The HTTP client. ``auto``: the gateway's own lean clients, HTTP/1.1
    #: (``adapters/h1.py``) or with ``http2`` HTTP/2 (``adapters/h2client.py``);
    #: ``httpx2``: httpx2 always (HTTP/2 with ``http2``).
    client: Literal["auto", "httpx2"] = "auto"
    #: The backend's API: ``chat`` (``POST {base_url}/chat/completions``) or
    #: ``responses`` (``POST {base_url}/responses``: it serves ``responses`` routes,
    #: whose clients' requests and its events then pass through natively).
    wire: Literal["chat", "responses"] = "chat"

    def __post_init__(self) -> None:
        super().__post_init__()
        _models(self.models)
        not_above(self, "backoff_base_ms", "backoff_max_ms")


class VllmWsAdapterConfig(Section, tag="vllm_ws", tag_field="kind"):
    #: ``ws://host:port/path`` of the model server (aiserve-sim: ``/v1/ws``).
    url: str
    models: list[str] = msgspec.field(default_factory=list)
    upstream_model: str | None = None
    #: Idle connections kept for reuse (more may be open while busy).
    pool_size: int = 8
    connect_timeout_ms: int = 2_000
    max_retries: int = 2
    backoff_base_ms: int = 100
    backoff_max_ms: int = 2_000
    context_window: int = 8_192
    tokenizer: str | None = None
    #: Extra headers sent with the WebSocket handshake.
    headers: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        _models(self.models)
        not_above(self, "backoff_base_ms", "backoff_max_ms")


class GroupDeployment(Section):
    """One deployment of a group: a configured adapter and its share of the traffic."""

    adapter: str
    #: Relative share (``balance = "weighted"``); divides the outstanding count otherwise.
    weight: float = 1.0
    #: Expected time to first token before any is measured; default: the group's.
    ttft_prior_ms: float | None = None

    def __post_init__(self) -> None:
        positive(self, "weight")
        if self.ttft_prior_ms is not None and self.ttft_prior_ms < 0:
            raise field_error("ttft_prior_ms", "must not be negative")


class GroupAdapterConfig(Section, tag="group", tag_field="kind"):
    """Several adapters serving the same models, with fallbacks (``adapters/group.py``)."""

    models: list[str]
    deployments: list[GroupDeployment]
    #: How a request picks its deployment.
    balance: Literal["least_outstanding", "weighted", "lowest_ttft"] = "least_outstanding"
    #: Other adapters or groups, tried in order once every deployment failed.
    fallbacks: list[str] = msgspec.field(default_factory=list)
    #: A second try on another deployment when the first has no token after its P95 TTFT.
    hedge: bool = False
    #: Expected TTFT of a deployment or fallback before any is measured (a mock: its ttft_ms).
    ttft_prior_ms: float = 500.0
    #: Per fallback adapter: its expected TTFT before any is measured.
    fallback_ttft_prior_ms: dict[str, float] = msgspec.field(default_factory=dict)
    #: Passive health: the sliding window and what ejects a deployment.
    window_s: float = 30.0
    min_requests: int = 5
    max_error_rate: float = 0.5
    max_timeout_rate: float = 0.5
    consecutive_failures: int = 5
    #: Eject when the window's P95 TTFT exceeds this (0: never for TTFT).
    max_ttft_p95_ms: float = 0.0
    #: Cool-down: base x consecutive ejections, at most max.
    base_ejection_ms: int = 5_000
    max_ejection_ms: int = 300_000
    max_ejected_percent: int = 50
    #: After its first token, a try that sends nothing for this long is stalled: cut, and
    #: held against its deployment (a hung worker); 0: never (``adapters/group.py``).
    #: Raise it for backends that send in large, far-apart chunks.
    stall_ms: int = 2_000
    #: Active health: a probe of each deployment every this many ms (0: off).
    probe_interval_ms: int = 0
    probe_timeout_ms: int = 1_000
    #: What a probe asks: "completion" (two tokens, finished within probe_timeout_ms) or
    #: "models" (the member's cheap check: GET /v1/models, which a stuck server may answer).
    probe: Literal["completion", "models"] = "completion"

    def __post_init__(self) -> None:
        _models(self.models)
        if not self.deployments:
            raise field_error("deployments", "must name at least one deployment")
        names = [d.adapter for d in self.deployments] + self.fallbacks
        for name in names:
            if names.count(name) > 1:
                raise field_error("deployments", f"{name!r} is named more than once")
        positive(self, "window_s", "min_requests", "consecutive_failures")
        positive(self, "base_ejection_ms", "max_ejection_ms", "probe_timeout_ms")
        for key in ("max_error_rate", "max_timeout_rate"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise field_error(key, "must be in (0, 1]")
        if not 0 <= self.max_ejected_percent <= 100:
            raise field_error("max_ejected_percent", "must be between 0 and 100")
        not_above(self, "base_ejection_ms", "max_ejection_ms")
        for key in ("ttft_prior_ms", "max_ttft_p95_ms", "probe_interval_ms", "stall_ms"):
            if getattr(self, key) < 0:
                raise field_error(key, "must not be negative")
        for name, ms in self.fallback_ttft_prior_ms.items():
            if name not in self.fallbacks:
                raise field_error("fallback_ttft_prior_ms", f"{name!r} is not a fallback")
            if ms < 0:
                raise field_error("fallback_ttft_prior_ms", "must not be negative")


class NativeAdapterConfig(UpstreamTLS):
    """What every native provider adapter's table has (``adapters/native.py``)."""

    #: The provider's API root; default: its public endpoint.
    base_url: str = ""
    #: Public names, or public name -> the provider's name (a deployment, a model id).
    models: list[str] | dict[str, str] = msgspec.field(default_factory=list)
    #: Name of the environment variable holding the API key.
    api_key_env: str | None = None
    #: Concurrent upstream requests before more queue.
    max_connections: int = 512
    connect_timeout_ms: int = 2_000
    #: Retries before the first token (connect errors, timeouts, 429, 529, 5xx).
    max_retries: int = 2
    backoff_base_ms: int = 100
    backoff_max_ms: int = 2_000
    context_window: int = 200_000
    tokenizer: str | None = None
    #: Extra headers sent upstream on every request.
    headers: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        _models(list(self.models))
        positive(self, "max_connections", "connect_timeout_ms", "context_window")
        if self.max_retries < 0:
            raise field_error("max_retries", "must not be negative")


class AnthropicAdapterConfig(NativeAdapterConfig, tag="anthropic", tag_field="kind"):
    """Anthropic's Messages API (``adapters/anthropic.py``)."""

    #: The ``anthropic-version`` header.
    anthropic_version: str = "2023-06-01"
    #: ``max_tokens`` when neither the client nor the route gives one (Anthropic needs it).
    max_tokens: int = 4_096

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_tokens")


class AzureOpenAIAdapterConfig(NativeAdapterConfig, tag="azure_openai", tag_field="kind"):
    """Azure OpenAI chat completions (``adapters/azure_openai.py``); ``base_url`` is the
    resource's endpoint (``https://NAME.openai.azure.com``); a model's mapped name is its
    deployment."""

    #: The ``api-version`` query parameter.
    api_version: str = "2024-10-21"
    #: Name of the environment variable holding an Entra ID bearer token (instead of a key).
    token_env: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.base_url:
            raise field_error("base_url", "required: the resource's endpoint")
        if self.api_key_env and self.token_env:
            raise field_error("token_env", "give `api_key_env` or `token_env`, not both")


class GeminiAdapterConfig(NativeAdapterConfig, tag="gemini", tag_field="kind"):
    """Google's Gemini API (``adapters/gemini.py``)."""


class BedrockAdapterConfig(NativeAdapterConfig, tag="bedrock", tag_field="kind"):
    """Amazon Bedrock's Converse API (``adapters/bedrock.py``); a model's mapped name is
    its model id (or inference profile)."""

    #: The AWS region: the signature's, and the default endpoint's.
    region: str = ""
    #: A named profile of the standard AWS credential chain (default: its usual order,
    #: the AWS_* environment variables first).
    profile: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d", self.region):
            why = f"an AWS region like us-east-1 is required, got {self.region!r}"
            raise field_error("region", why)


AdapterConfig = (
    MockAdapterConfig
    | OpenAIAdapterConfig
    | VllmWsAdapterConfig
    | GroupAdapterConfig
    | AnthropicAdapterConfig
    | AzureOpenAIAdapterConfig
    | GeminiAdapterConfig
    | BedrockAdapterConfig
)


class Kind(NamedTuple):
    """One kind of adapter: its table's Struct and the adapter built from it."""

    settings: type[AdapterConfig]
    #: ``module:Class`` of this package, imported when an adapter of the kind is built
    #: (a config without the kind does not pay for its client library); empty: built
    #: otherwise (a group holds the adapters it names: ``build_adapters``).
    adapter: str


#: Every kind of adapter by its ``kind`` tag (``kind = "openai"``).
KINDS: dict[str, Kind] = {
    "mock": Kind(MockAdapterConfig, "mock:MockAdapter"),
    "openai": Kind(OpenAIAdapterConfig, "openai:OpenAIAdapter"),
    "vllm_ws": Kind(VllmWsAdapterConfig, "vllm_ws:VllmWsAdapter"),
    "group": Kind(GroupAdapterConfig, ""),
    "anthropic": Kind(AnthropicAdapterConfig, "anthropic:AnthropicAdapter"),
    "azure_openai": Kind(AzureOpenAIAdapterConfig, "azure_openai:AzureOpenAIAdapter"),
    "gemini": Kind(GeminiAdapterConfig, "gemini:GeminiAdapter"),
    "bedrock": Kind(BedrockAdapterConfig, "bedrock:BedrockAdapter"),
}


def adapter_kind(adapter: AdapterConfig) -> str:
    """The ``kind`` of an adapter's table (``"openai"``, ``"group"``...)."""
    return str(type(adapter).__struct_config__.tag)


#: How a check names a problem: the TOML key and why (``config.check_config`` adds the file).
Fail = Callable[[str, str], Exception]


def check_groups(adapters: Mapping[str, AdapterConfig], fail: Fail) -> None:
    """Groups name configured adapters, none twice, and never contain themselves."""
    groups = {n: a for n, a in adapters.items() if isinstance(a, GroupAdapterConfig)}
    for name, group in groups.items():
        named = [(f"deployments[{i}].adapter", d.adapter) for i, d in enumerate(group.deployments)]
        named += [(f"fallbacks[{i}]", f) for i, f in enumerate(group.fallbacks)]
        for where, member in named:
            key = f"adapters.{name}.{where}"
            if member not in adapters:
                known = ", ".join(sorted(adapters))
                raise fail(key, f"unknown adapter {member!r} (configured: {known})")
            if where.startswith("deployments") and member in groups:
                raise fail(key, f"{member!r} is a group: groups go in `fallbacks`")
    # A fallback chain that comes back to a group would loop for ever.
    for start in groups:
        path = [start]
        todo = [(start, path)]
        while todo:
            node, trail = todo.pop()
            for nxt in groups[node].fallbacks:
                if nxt == start:
                    cycle = " -> ".join([*trail, nxt])
                    raise fail(f"adapters.{start}.fallbacks", f"fallbacks loop: {cycle}")
                if nxt in groups and nxt not in trail:
                    todo.append((nxt, [*trail, nxt]))
