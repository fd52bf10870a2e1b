"""``aiserve-sim``: run the simulated model backend on hypercorn's Trio worker."""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Sequence
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from .app import SimApp
from .dialect import DIALECTS
from .model import FaultRates, FaultSpecError, SimSettings, Timing, parse_fault
from .ws import WS_PATH

DEFAULT_BIND = "127.0.0.1:8100"
#: The listen backlog: what a production backend has (nginx 511, uvicorn 2048), not
#: hypercorn's 100, which a connect storm overflows (docs/performance.md).
DEFAULT_BACKLOG = 4096
_T = Timing()
_R = FaultRates()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiserve-sim",
        description="Simulated OpenAI-compatible (HTTP SSE/JSON) and WebSocket model backend: "
        "chat completions with tools, structured output, reasoning, logprobs and images; "
        "embeddings.",
        epilog="Endpoints: POST /v1/chat/completions, POST /v1/embeddings, GET /v1/models, "
        f"WebSocket {WS_PATH}; GET /sim/stats, GET /sim/requests (the last requests as "
        "received), POST /sim/reset. Per request: X-Sim-Fault, X-Sim-Fault-Times, "
        "X-Request-Timeout-Ms. The protocols: pydoc aiserve_trio.sim",
    )
    p.add_argument("--bind", default=DEFAULT_BIND, help=f"host:port (default {DEFAULT_BIND})")
    p.add_argument(
        "--backlog",
        type=_positive,
        default=DEFAULT_BACKLOG,
        help=f"the listen backlog: connections the kernel holds for accepting (default "
        f"{DEFAULT_BACKLOG}, Linux's usual somaxconn, which caps it; hypercorn's own is 100, "
        "and a burst of new connections past it waits out SYN retransmits)",
    )
    p.add_argument("--model", action="append", dest="models", help="served model name (repeat)")
    p.add_argument("--seed", type=int, default=None, help="seed for jitter and random faults")
    t = p.add_argument_group("timing (milliseconds)")
    t.add_argument("--prefill-overhead-ms", type=float, default=_T.prefill_overhead_ms)
    t.add_argument("--prefill-per-token-ms", type=float, default=_T.prefill_per_token_ms)
    t.add_argument("--ttft-std-ms", type=float, default=_T.ttft_std_ms)
    t.add_argument("--itl-ms", type=float, default=_T.itl_ms)
    t.add_argument("--itl-std-ms", type=float, default=_T.itl_std_ms)
    t.add_argument("--output-tokens-mean", type=float, default=_T.output_tokens_mean)
    t.add_argument("--output-tokens-std", type=float, default=_T.output_tokens_std)
    f = p.add_argument_group("faults")
    f.add_argument(
        "--fault",
        default=None,
        help="apply to every request: 429[:s], 5xx, stall:N, drop:N, malformed:N",
    )
    f.add_argument("--rate-429", type=float, default=_R.rate_429)
    f.add_argument("--rate-5xx", type=float, default=_R.rate_5xx)
    f.add_argument("--status-5xx", type=int, default=_R.status_5xx)
    f.add_argument("--rate-stall", type=float, default=_R.rate_stall)
    f.add_argument("--rate-drop", type=float, default=_R.rate_drop)
    f.add_argument("--rate-malformed", type=float, default=_R.rate_malformed)
    f.add_argument("--fault-after", type=int, default=_R.after, help="tokens before a random fault")
    f.add_argument(
        "--retry-after", type=float, default=_R.retry_after, help="Retry-After of random 429s"
    )
    p.add_argument(
        "--dialect",
        action="append",
        dest="dialects",
        choices=DIALECTS,
        help="serve only this provider dialect (repeat; default: every one, each under its "
        "paths: anthropic /v1/messages, azure /openai/deployments/D/chat/completions, "
        "gemini /v1beta/models/M:streamGenerateContent, bedrock /model/M/converse-stream)",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    tls = p.add_argument_group("TLS (HTTPS and WSS)")
    tls.add_argument("--certfile", default=None, help="PEM certificate chain: serve over TLS")
    tls.add_argument("--keyfile", default=None, help="PEM private key of --certfile")
    tls.add_argument(
        "--require-client-cert",
        metavar="CA",
        default=None,
        help="PEM CA bundle: refuse a client without a certificate it signed (mTLS)",
    )
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}")
    return value


def tls_error(ns: argparse.Namespace) -> str | None:
    """What is wrong with the TLS options, if anything."""
    if (ns.certfile is None) != (ns.keyfile is None):
        return "--certfile and --keyfile go together"
    if ns.require_client_cert is not None and ns.certfile is None:
        return "--require-client-cert needs --certfile and --keyfile"
    for flag, path in (
        ("--certfile", ns.certfile),
        ("--keyfile", ns.keyfile),
        ("--require-client-cert", ns.require_client_cert),
    ):
        if path is not None and not os.access(path, os.R_OK):
            return f"{flag}: cannot read {path}"
    return None


def settings_from_args(ns: argparse.Namespace) -> SimSettings:
    """The simulator settings the parsed command line describes.

    Raises:
        FaultSpecError: ``--fault`` is not a valid spec.
    """
    timing = Timing(
        prefill_overhead_ms=ns.prefill_overhead_ms,
        prefill_per_token_ms=ns.prefill_per_token_ms,
        ttft_std_ms=ns.ttft_std_ms,
        itl_ms=ns.itl_ms,
        itl_std_ms=ns.itl_std_ms,
        output_tokens_mean=ns.output_tokens_mean,
        output_tokens_std=ns.output_tokens_std,
    )
    rates = FaultRates(
        rate_429=ns.rate_429,
        rate_5xx=ns.rate_5xx,
        status_5xx=ns.status_5xx,
        rate_stall=ns.rate_stall,
        rate_drop=ns.rate_drop,
        rate_malformed=ns.rate_malformed,
        after=ns.fault_after,
        retry_after=ns.retry_after,
    )
    return SimSettings(
        timing=timing,
        rates=rates,
        fault=parse_fault(ns.fault) if ns.fault else None,
        models=ns.models or ["sim-model"],
        seed=ns.seed,
        dialects=tuple(ns.dialects) if ns.dialects else DIALECTS,
    )


def hypercorn_config(ns: argparse.Namespace) -> HypercornConfig:
    """Hypercorn's configuration for the parsed command line."""
    config = HypercornConfig()
    config.bind = [ns.bind]
    config.backlog = ns.backlog
    if ns.certfile is not None:
        config.certfile = ns.certfile
        config.keyfile = ns.keyfile
    if ns.require_client_cert is not None:
        config.ca_certs = ns.require_client_cert
        config.verify_mode = ssl.CERT_REQUIRED
    config.accesslog = "-" if ns.access_log else None
    config.errorlog = "-"
    config.keep_alive_timeout = 30
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aiserve-sim`` console script."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        settings = settings_from_args(ns)
    except FaultSpecError as exc:
        parser.error(str(exc))
    problem = tls_error(ns)
    if problem is not None:
        parser.error(problem)
    config = hypercorn_config(ns)
    scheme = "HTTPS" if ns.certfile is not None else "HTTP"
    print(
        f"aiserve-sim: serving on {ns.bind} ({scheme}, and WebSocket at {WS_PATH})",
        file=sys.stderr,
    )
    try:
        app: Any = SimApp(settings)  # hypercorn's ASGI types are narrower than our dicts
        trio.run(serve, app, config)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
