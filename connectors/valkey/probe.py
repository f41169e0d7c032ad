"""Is a Valkey server there? Asked on the event loop before glide is asked to connect.

glide 2.x's ``GlideClient.create`` connects inside a synchronous call into its native library
(only its credential-provider path runs in a thread), so while the server is down, stopped or
silent it holds the event loop for the whole ``connect_timeout``, once per client: with two
clients, every get and put of the process, from memory too, stalled for 10 s on each try.
The probe opens a connection of its own (asyncio, with the endpoint's TLS settings) and sends
a PING: any reply, ``-NOAUTH`` included, is a server that answers, and glide then connects in
a moment. No reply ends the probe with kvgate's error, the loop free all along. A server that
goes away between the probe and glide's connect can still hold the loop once, for at most
``connect_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence

from connectors.valkey.config import Endpoint, ValkeyOptions
from gateway.errors import ConfigError, Timeout, Unavailable

_PING = b"*1\r\n$4\r\nPING\r\n"


def probe_tls(endpoint: Endpoint, options: ValkeyOptions) -> ssl.SSLContext | None:
    """The TLS context the probe connects with: the same trust and client certificate as
    glide's (``tls_ca_file``, ``tls_cert_file``/``tls_key_file``, ``tls_insecure``)."""
    if not endpoint.tls:
        return None
    try:
        context = ssl.create_default_context(
            cafile=str(options.tls_ca_file) if options.tls_ca_file else None
        )
        if options.tls_cert_file is not None and options.tls_key_file is not None:
            context.load_cert_chain(options.tls_cert_file, options.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{endpoint.display}: cannot load the TLS files: {exc}") from None
    if options.tls_insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


async def _answers(host: str, port: int, tls: ssl.SSLContext | None) -> None:
    reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    try:
        writer.write(_PING)
        await writer.drain()
        reply = await reader.readline()
        if not reply:
            raise ConnectionResetError(f"{host}:{port} closed the connection without a reply")
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def server_answers(
    target: str, addresses: Sequence[tuple[str, int]], tls: ssl.SSLContext | None, seconds: float
) -> None:
    """Return once one of ``addresses`` (a cluster's seeds, or the one server) answers a PING;
    otherwise raise ``Unavailable`` (refused, reset) or ``Timeout`` (no reply in ``seconds``)."""
    errors: list[BaseException] = []
    probes = [asyncio.ensure_future(_answers(host, port, tls)) for host, port in addresses]
    try:
        async with asyncio.timeout(seconds):
            for done in asyncio.as_completed(probes):
                try:
                    await done
                    return
                except (OSError, ssl.SSLError, EOFError) as exc:
                    errors.append(exc)
    except TimeoutError:
        raise Timeout(
            f"{target}: no reply to a PING within {seconds} s (connect_timeout): the server "
            "is stopped, overloaded or not a Valkey/Redis server"
        ) from None
    finally:
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
    raise Unavailable(f"{target}: connection failed: {errors[0]}")
