"""Real-server fixtures, shared by the conformance runners and the fault tests.

Each backend's fixtures live in ``tests/servers/<backend>.py``; they are imported here so that
every test module sees them.
"""

import asyncio
import os
from collections.abc import Callable, Mapping

import pytest
from servers.azurite import azurite_server, azurite_server_private  # noqa: F401
from servers.ftp import ftp_server  # noqa: F401
from servers.gcs_emulator import gcs_server, gcs_server_private  # noqa: F401
from servers.lmcache import lmcache_server  # noqa: F401
from servers.memcached import memcached_factory, memcached_server  # noqa: F401
from servers.mooncake import mooncake_cluster, mooncake_factory  # noqa: F401
from servers.redis import *  # noqa: F403 (its __all__: the Redis fixtures)
from servers.redis_script import make_conn, scripted  # noqa: F401
from servers.s3 import s3_server, s3_server_private  # noqa: F401
from servers.small_disk import small_disk  # noqa: F401
from servers.valkey import valkey_cluster, valkey_server, valkey_tls_certs, valkey_tls_server  # noqa: F401
from servers.webdav import webdav_private, webdav_server  # noqa: F401

# -- event loops ----------------------------------------------------------------------------
# `kvgate serve` runs on uvloop (the serve extra installs it), while pytest-asyncio's default
# loop is asyncio's own. Transports differ between the two (uvloop's are not asyncio.Transport
# subclasses), so the transports' tests run on both: a module opts in with
# ``pytestmark = pytest.mark.both_loops``.
try:
    import uvloop
except ImportError:  # pragma: no cover - the serve extra is not installed
    uvloop = None  # type: ignore[assignment]
    if os.environ.get("CI") == "true":
        raise

_ASYNCIO_ONLY: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop
}
_BOTH_LOOPS: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = (
    {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    if uvloop is not None
    else _ASYNCIO_ONLY
)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return _BOTH_LOOPS if item.get_closest_marker("both_loops") else _ASYNCIO_ONLY
