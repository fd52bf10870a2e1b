"""The hypercorn the gateway's seam (``server/``) was written against.

The seam subclasses hypercorn's Trio ``TCPServer``, its task group, its protocol
wrapper and its HTTP/1.1 and HTTP/2 protocols, and reimplements or calls some of
their methods. Each such method is pinned here by a fingerprint of its source
(:data:`PINNED`): a hypercorn release that changes one of them changes what the
seam's subclass would override or rely on, and the seam refuses to install
(:func:`problems`) rather than silently replace what hypercorn fixed. Outside
:data:`SUPPORTED` it refuses too. The seam also subclasses h2's server connection (the
HTTP/2 library under hypercorn's protocol): the h2 methods it overrides or relies on
are pinned the same way; the gateway's upstream HTTP/2 client
(``adapters/h2client.py``) overrides one of them, ``_receive_goaway_frame``, as the
seam does. Nothing here imports or changes hypercorn at import time.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

#: hypercorn versions (major, minor) the seam was written against; ``pyproject.toml``
#: pins the same range (a test holds them together).
SUPPORTED = ((0, 18),)

#: hypercorn's methods and functions the seam overrides, reimplements or calls, by
#: dotted path (module:qualname), with the first 16 hex digits of the sha256 of their
#: source in hypercorn 0.18.0; and the three of h2 4.4.1 (hypercorn's HTTP/2 library)
#: whose connection class the seam subclasses.
PINNED: dict[str, str] = {
    # the one place the seam is installed, and the config it reads at start-up
    "hypercorn.trio.run:worker_serve": "8dc8347a9fc357ca",
    "hypercorn.trio.lifespan:Lifespan.__init__": "5ca218602b599d6e",
    # GatewayTCPServer
    "hypercorn.trio.tcp_server:TCPServer.__init__": "4c1d42457bc197b2",
    "hypercorn.trio.tcp_server:TCPServer.run": "fd34b021d1a86c98",
    "hypercorn.trio.tcp_server:TCPServer.protocol_send": "225856426bff7be0",
    "hypercorn.trio.tcp_server:TCPServer._read_data": "7ca747d922c65cf1",
    "hypercorn.trio.tcp_server:TCPServer._close": "bc73c4ae25a1ceec",
    "hypercorn.trio.tcp_server:TCPServer._idle_timeout": "210ce1014d98e1cb",
    "hypercorn.trio.tcp_server:TCPServer._initiate_server_close": "7c1b548a65adc8b1",
    # the task group that starts the app
    "hypercorn.trio.task_group:TaskGroup.spawn_app": "b4c1131427529801",
    "hypercorn.trio.task_group:TaskGroup.__aenter__": "38047eb0284cdaa6",
    "hypercorn.trio.task_group:_handle": "06081a56a9930825",
    "hypercorn.utils:parse_socket_addr": "d06f08a6dc9ef687",
    # the protocol wrapper that picks HTTP/1.1 or HTTP/2
    "hypercorn.protocol:ProtocolWrapper.__init__": "df25e181b9e2e64d",
    "hypercorn.protocol:ProtocolWrapper.handle": "b03e2962872c85e8",
    # HTTP/1.1 writes coalesced
    "hypercorn.protocol.h11:H11Protocol._send_h11_event": "5e40283daa303ec7",
    "hypercorn.protocol.h11:H11Protocol.stream_send": "56a36254a368d71a",
    # what the app's send and the disconnect call rely on
    "hypercorn.protocol.http_stream:HTTPStream.handle": "6ed2e34c5e708c6a",
    "hypercorn.protocol.http_stream:HTTPStream.app_send": "c806044b99736985",
    # the HTTP/2 guard
    "hypercorn.protocol.h2:H2Protocol.handle": "c67e89eb79af9032",
    "hypercorn.protocol.h2:H2Protocol._handle_events": "3378aef0a2348f0d",
    "hypercorn.protocol.h2:H2Protocol._flush": "1a771e85178d124c",
    # HTTP/2 backpressure, stream refusal and the client's GOAWAY (GatewayH2,
    # WindowedBuffer): what is rebuilt, overridden or called
    "hypercorn.protocol.h2:H2Protocol.__init__": "d577a96e2eb647a4",
    "hypercorn.protocol.h2:H2Protocol._create_stream": "91eb123ddf247ede",
    "hypercorn.protocol.h2:H2Protocol._send_data": "a89ce4286f369820",
    "hypercorn.protocol.h2:H2Protocol.stream_send": "d8fc824e2770ba5c",
    "hypercorn.protocol.h2:H2Protocol._window_updated": "80fdf9db83dd916e",
    "hypercorn.protocol.h2:StreamBuffer.__init__": "d6c8c726e2c0cf88",
    "hypercorn.protocol.h2:StreamBuffer.push": "4ca8ee7b0fec5200",
    "hypercorn.protocol.h2:StreamBuffer.pop": "9eb73c8833891346",
    "hypercorn.protocol.h2:StreamBuffer.close": "f6a32abdf98270c5",
    "hypercorn.protocol.h2:StreamBuffer.drain": "48e7a2a9a7be2b77",
    # h2 (hypercorn's HTTP/2 library), whose connection the seam subclasses
    # (GatewayConnection, AdvertisedLimits): h2 4.4.1
    "h2.connection:H2Connection.__init__": "e5c93da64d0e6476",
    # ... and so does the upstream HTTP/2 client (adapters/h2client.py, _H2Connection)
    "h2.connection:H2Connection._receive_goaway_frame": "adb9adfae94088c4",
    "h2.connection:H2Connection._receive_headers_frame": "4a014e7d795a15a5",
    # the Date header
    "hypercorn.config:Config.response_headers": "5a637c3d48180e55",
}


def supported(version: str) -> bool:
    """Whether the seam was written for hypercorn ``version``."""
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) in SUPPORTED
    except (IndexError, ValueError):
        return False


def fingerprint(path: str) -> str:
    """The fingerprint of the hypercorn function at ``path`` (``module:qualname``).

    Raises:
        LookupError: the module or the name is not there.
    """
    module_name, _, qualname = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"{module_name} cannot be imported") from exc
    for part in qualname.split("."):
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError as exc:
            raise LookupError(f"{path} is not there") from exc
    try:
        source = inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError) as exc:
        raise LookupError(f"the source of {path} is not readable") from exc
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def problems(pinned: dict[str, str] | None = None) -> list[str]:
    """Why the seam must not be installed on this hypercorn; empty when it may.

    Args:
        pinned: the fingerprints to check (tests give their own); :data:`PINNED` by default.
    """
    try:
        hv = dist_version("hypercorn")
    except PackageNotFoundError:
        return ["hypercorn is not installed"]
    if not supported(hv):
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        return [f"hypercorn {hv} is not a version the seam was written for ({known})"]
    out = []
    for path, want in (PINNED if pinned is None else pinned).items():
        try:
            got = fingerprint(path)
        except LookupError as exc:
            out.append(str(exc))
            continue
        if got != want:
            out.append(f"{path} changed (fingerprint {got}, the seam knows {want})")
    return out
