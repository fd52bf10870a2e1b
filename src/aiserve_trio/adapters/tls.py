"""TLS to a backend, as the lean client (``h1.py``) uses it: the context, the name to
verify, the session to resume, and each handshake reported.

The context comes from the adapter's settings (``settings.UpstreamTLS``: ``ca_file``,
``client_cert`` / ``client_key``, ``server_name``, ``tls_min_version``); it always
verifies the certificate and the name. One :class:`TLSSettings` per backend keeps
the newest session the backend gave (a TLS 1.3 ticket or a TLS 1.2 session), and a
new connection offers it: the handshake is then one round trip shorter and skips
the certificate exchange (docs/benchmarks.md, upstream TLS, measures it).
:func:`check_tls_files` reads the files once when the config is loaded (their paths
made absolute, a digest of their bytes, a key others may read refused).

:func:`reason` turns an ``ssl`` failure into the words an operator needs: unknown
CA, expired certificate, name mismatch, client certificate refused, no protocol
version in common.
"""

from __future__ import annotations

import hashlib
import ssl
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final, final

import msgspec

from ..core.decoding import confined, outside
from ..core.errors import ConfigError
from .settings import UpstreamTLS

__all__ = ["TLSFileError", "TLSSettings", "check_tls_files", "client_tls_context", "reason"]

#: What a handshake was, for ``aiserve_upstream_tls_handshakes_total{kind}``.
FULL: Final = "full"
RESUMED: Final = "resumed"


_TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


class TLSFileError(ValueError):
    """A TLS file of an adapter cannot be used; ``field`` names its key."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


def client_tls_context(tls: UpstreamTLS) -> ssl.SSLContext:
    """The verifying client context ``tls`` describes (paths as the loader resolved them).

    Raises:
        TLSFileError: a file cannot be read or is not what it should be (PEM), or
            the key does not match the certificate; naming the field.
    """
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TLSFileError("ca_file", _why(exc)) from None
    ctx.minimum_version = _TLS_VERSIONS[tls.tls_min_version]
    if tls.client_cert is not None:
        try:
            ctx.load_cert_chain(tls.client_cert, tls.client_key)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFileError("client_cert", _why(exc)) from None
    return ctx


def _why(exc: OSError) -> str:
    reason = getattr(exc, "reason", None)
    return f"not usable ({reason or exc.strerror or exc})"


def check_tls_files(
    tls: UpstreamTLS,
    key: str,
    base_dir: str,
    source: str,
    roots: tuple[str, ...] | None = None,
) -> UpstreamTLS:
    """``tls`` with its paths made absolute and the digest of its files' bytes.

    Args:
        roots: the folders the files must be in (``decoding.config_roots``); None: any.

    Raises:
        ConfigError: one line naming ``source`` and ``key.<field>``: a file is
            outside ``roots``, cannot be read, the key is readable by others, or
            a file is not valid PEM.
    """
    paths: dict[str, str] = {}
    digest = hashlib.blake2b(digest_size=8)
    for field in ("ca_file", "client_cert", "client_key"):
        value = getattr(tls, field)
        if value is None:
            continue
        path = Path(base_dir) / value
        if not confined(str(path), roots):
            raise ConfigError(f"{source}: key `{key}.{field}`: {outside('the file', value)}")
        try:
            digest.update(path.read_bytes())
            mode = path.stat().st_mode
        except OSError as exc:
            why = f"cannot read {path}: {exc.strerror}"
            raise ConfigError(f"{source}: key `{key}.{field}`: {why}") from None
        if field == "client_key" and mode & stat.S_IROTH:
            why = f"{path} is readable by others (chmod o-r, or 600)"
            raise ConfigError(f"{source}: key `{key}.{field}`: {why}")
        paths[field] = str(path)
    resolved = msgspec.structs.replace(tls, **paths, tls_files_digest=digest.hexdigest())
    try:
        client_tls_context(resolved)
    except TLSFileError as exc:
        raise ConfigError(f"{source}: key `{key}.{exc.field}`: {exc.why}") from None
    return resolved


@final
class TLSSettings:
    """TLS to one backend: its context, the name it must prove, its last session."""

    __slots__ = ("context", "on_handshake", "server_name", "session")

    def __init__(
        self,
        context: ssl.SSLContext,
        server_name: str,
        on_handshake: Callable[[str], None] | None = None,
    ) -> None:
        """Args:
        context: a verifying client context.
        server_name: sent in SNI and checked against the certificate.
        on_handshake: told ``"full"`` or ``"resumed"`` after each handshake.
        """
        self.context = context
        self.server_name = server_name
        self.on_handshake = on_handshake
        #: The newest session the backend gave; offered by the next new connection.
        self.session: ssl.SSLSession | None = None

    @classmethod
    def from_config(
        cls, tls: UpstreamTLS, host: str, on_handshake: Callable[[str], None] | None = None
    ) -> TLSSettings:
        """The settings of an adapter's TLS fields for a backend at ``host``.

        Raises:
            TLSFileError: a file became unreadable or invalid since it was loaded.
        """
        context = client_tls_context(tls)
        context.set_alpn_protocols(["http/1.1"])
        return cls(context, tls.server_name or host, on_handshake)

    def handshake_done(self, sock: ssl.SSLObject | ssl.SSLSocket) -> None:
        """Count a finished handshake (full or resumed)."""
        if self.on_handshake is not None:
            self.on_handshake(RESUMED if sock.session_reused else FULL)

    def keep_session(self, sock: ssl.SSLObject | ssl.SSLSocket) -> bool:
        """Keep ``sock``'s session for the next connection (once its tickets have come).

        Returns whether it was kept: a TLS 1.3 connection whose tickets have not come
        yet is asked again at its next release. Reading ``sock.session`` costs a copy
        of the session with its certificate chain (CPython duplicates TLS 1.3 sessions
        by encoding and decoding them: ~170 us), so callers ask once per connection.
        """
        session = sock.session
        if session is not None and (session.has_ticket or sock.version() != "TLSv1.3"):
            self.session = session
            return True
        return False


#: OpenSSL reasons of an alert the backend sent about our client certificate.
_CLIENT_CERT_REFUSED = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_ACCESS_DENIED",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "TLSV1_ALERT_DECRYPT_ERROR",
    }
)
_PROTOCOL_MISMATCH = frozenset(
    {
        "TLSV1_ALERT_PROTOCOL_VERSION",
        "UNSUPPORTED_PROTOCOL",
        "NO_PROTOCOLS_AVAILABLE",
        "WRONG_VERSION_NUMBER",
        "VERSION_TOO_LOW",
        "TLSV1_ALERT_INAPPROPRIATE_FALLBACK",
        "NO_SHARED_CIPHER",
        "SSLV3_ALERT_HANDSHAKE_FAILURE",
    }
)
#: X.509 verification codes (OpenSSL's X509_V_ERR_*).
_UNKNOWN_CA = frozenset({2, 18, 19, 20, 21})
_EXPIRED = 10
_NOT_YET_VALID = 9
_NAME_MISMATCH = 62


def reason(exc: ssl.SSLError) -> str:
    """What went wrong in words an operator acts on (the library's own words in brackets)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        said = exc.verify_message
        if code in _UNKNOWN_CA:
            return f"unknown CA: the certificate is not signed by a trusted CA ({said})"
        if code == _EXPIRED:
            return f"the certificate has expired ({said})"
        if code == _NOT_YET_VALID:
            return f"the certificate is not yet valid ({said})"
        if code == _NAME_MISMATCH:
            return f"name mismatch: the certificate is not for this host ({said})"
        return f"the certificate was not accepted ({said})"
    why = exc.reason or ""
    if why in _CLIENT_CERT_REFUSED:
        return f"the backend refused the client certificate ({why.lower()})"
    if why in _PROTOCOL_MISMATCH:
        return f"no TLS protocol version or cipher in common ({why.lower()})"
    return f"the TLS connection failed ({why.lower() or exc})"
