"""TLS on the proxy listener: the context made from the configured certificate and key.

What this module decides:

- **The context**: TLS 1.2 at least, the server's certificate chain and key from PEM
  files, and ALPN offering ``h2`` then ``http/1.1`` (a client that asks for neither
  gets HTTP/1.1). Python's defaults for ciphers and options, which are current.
- **A bad pair is a configuration error** (``ConfigError`` naming the file and the key
  ``tls.cert`` / ``tls.key``): missing or unreadable files, PEM that does not parse, a key
  that does not match the certificate. At start that is exit code 2; on reload the
  running context (and the whole running configuration) is kept, as for a bad YAML file.
- The files are read again on every reload (SIGHUP, a change of the YAML file, or a
  change of either file), so a renewed certificate is picked up without a restart;
  connections already open end gracefully (HTTP/2: GOAWAY; HTTP/1.x: after the answer
  in progress; ``engine.HttpServer.renew_connections``), so that their clients come back
  to the new certificate.
"""

from __future__ import annotations

import os
import ssl

from ..core.config import TlsConfig
from ..core.errors import ConfigError

ALPN = ("h2", "http/1.1")


def load_context(tls: TlsConfig, config_file: str = "") -> ssl.SSLContext:
    """The server context for ``tls``; raises ``ConfigError`` for a pair that cannot serve."""
    for key, path in (("tls.cert", tls.cert), ("tls.key", tls.key)):
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such file", filename=config_file, key=key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as error:
        raise ConfigError(
            f"cannot use {tls.cert} with {tls.key}: {error.reason or error}", filename=config_file, key="tls"
        ) from error
    except OSError as error:
        raise ConfigError(f"cannot read the certificate or key: {error}", filename=config_file, key="tls") from error
    context.set_alpn_protocols(list(ALPN))
    return context
