"""TLS to a backend, as the lean client (``h1.py``) uses it: the context, the name to
verify, the session to resume, and each handshake reported.

The context comes from the adapter's settings (``config.UpstreamTLS``: ``ca_file``,
``client_cert`` / ``client_key``, ``server_name``, ``tls_min_version``); it always
verifies the certificate and the name. One :class:`TLSSettings` per backend keeps
the newest session the backend gave (a TLS 1.3 ticket or a TLS 1.2 session), and a
new connection offers it: the handshake is then one round trip shorter and skips
the certificate exchange (``python -m bench.upstream_tls`` measures it).

:func:`reason` turns an ``ssl`` failure into the words an operator needs: unknown
CA, expired certificate, name mismatch, client certificate refused, no protocol
version in common.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Final, final

from ..config import UpstreamTLS, client_tls_context

__all__ = ["TLSSettings", "reason"]

#: What a handshake was, for ``aiserve_upstream_tls_handshakes_total{kind}``.
FULL: Final = "full"
RESUMED: Final = "resumed"


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
            config.TLSFileError: a file became unreadable or invalid since it was loaded.
        """
        context = client_tls_context(tls)
        context.set_alpn_protocols(["http/1.1"])
        return cls(context, tls.server_name or host, on_handshake)

    def handshake_done(self, sock: ssl.SSLSocket) -> None:
        """Count a finished handshake (full or resumed)."""
        if self.on_handshake is not None:
            self.on_handshake(RESUMED if sock.session_reused else FULL)

    def keep_session(self, sock: ssl.SSLSocket) -> bool:
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
