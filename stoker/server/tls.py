"""The server's TLS policy, applied to the context uvicorn builds from the
--ssl-* options: TLS 1.2 or newer and forward-secret AEAD ciphers only.

uvicorn's own default cipher string is "TLSv1", which still offers CBC suites
with SHA-1 MACs and static-RSA key exchange; a scanner (and a PCI audit) flags
those. TLS 1.3 suites are not touched by set_ciphers: OpenSSL's defaults there are
all AEAD.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2
# TLS 1.2: ECDHE key exchange, AES-GCM or ChaCha20-Poly1305 (Mozilla's "intermediate" profile, less DHE).
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL:!MD5:!DSS"


def harden(context: ssl.SSLContext) -> ssl.SSLContext:
    """context with the policy above (also what check_tls tries at start-up)."""
    context.minimum_version = MINIMUM_VERSION
    context.set_ciphers(CIPHERS)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    return context


def context_factory(_config: Any, default_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """uvicorn's ssl_context_factory: its context from the --ssl-* options, hardened."""
    return harden(default_factory())
