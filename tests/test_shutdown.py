"""Graceful shutdown with a real hypercorn process: SIGTERM stops accepting, a stream
that finishes within graceful_timeout finishes, one that cannot ends with a final error
event and [DONE] (not a torn connection), and the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from bench.hostile import ROOT

from .servers import hypercorn_gateway

pytestmark = pytest.mark.slow


def _stream(port: int, text: str, out: dict[str, bytes], path: str = "/v1/chat/completions") -> None:
    ask = {"model": "aiserve-mock", "stream": True, "messages": [{"role": "user", "content": text}]}
    if path == "/v1/messages":
        ask["max_tokens"] = 1000
    body = json.dumps(ask).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
    )
    buf = b""
    try:
        while chunk := sock.recv(65536):
            buf += chunk
            if buf.endswith(b"0\r\n\r\n"):
                break
    except OSError:
        pass
    sock.close()
    out[path if path != "/v1/chat/completions" else text] = buf


def test_sigterm_drains_then_ends_streams_with_an_error_event(tmp_path: Path) -> None:
    text = (ROOT / "src" / "aiserve_trio" / "aiserve.toml").read_text()
    text = text.replace("ttft_ms = 60", "ttft_ms = 10").replace(
        "inter_token_ms = 20", "inter_token_ms = 100"
    )
    cfg = tmp_path / "gw.toml"
    cfg.write_text(text)
    out: dict[str, bytes] = {}
    args = ["--graceful-timeout", "2", "--access-logfile", "/dev/null"]
    with hypercorn_gateway(cfg, extra_args=args) as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        # "xyzzy" gets the ~60-word default reply (~6 s), "echo: a b" finishes in ~0.3 s.
        threads = [
            threading.Thread(target=_stream, args=(port, t, out)) for t in ("xyzzy", "echo: a b")
        ]
        threads.append(threading.Thread(target=_stream, args=(port, "xyzzy", out, "/v1/messages")))
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(15)
        code = proc.wait(15)
        took = time.monotonic() - t0
    assert code == 0
    assert took < 6
    short, long_ = out["echo: a b"].decode(), out["xyzzy"].decode()
    assert "data: [DONE]" in short
    assert "shutting_down" not in short
    # The long one was cut at the graceful timeout with an error event, then [DONE].
    assert '"code":"shutting_down"' in long_, long_[-500:]
    assert "data: [DONE]" in long_
    assert long_.rstrip().endswith("0")  # the chunked body was ended, not torn
    # A Messages stream ends in its own API's form: Anthropic's error event.
    claude = out["/v1/messages"].decode()
    assert '"type":"overloaded_error"' in claude, claude[-500:]
    assert "shutting_down" in claude
    assert "[DONE]" not in claude
