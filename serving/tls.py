"""One TLS context per process for httpx's one-off requests and short-lived clients.

httpx builds its default TLS context, CA bundle loaded, for every client it makes, and
``httpx.get``/``httpx.post`` make one per call, even for an ``http://`` URL: about 40 ms of CPU
on the machines this was measured on (2-core Xeon and EPYC VMs). A loop that polls a local
server five times a second that way spends a fifth of a core on certificates. Pass
``verify=tls_context()`` to such calls and clients: the same settings, built once.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS settings (``httpx.create_ssl_context()``), built on first use."""
    import httpx

    return httpx.create_ssl_context()
