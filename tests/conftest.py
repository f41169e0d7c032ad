"""Real-server fixtures, shared by the conformance runners and the fault tests.

Each backend's fixtures live in ``tests/servers/<backend>.py``; they are imported here so that
every test module sees them.
"""

from servers.lmcache import lmcache_server  # noqa: F401
from servers.memcached import memcached_factory, memcached_server  # noqa: F401
from servers.mooncake import mooncake_cluster, mooncake_factory  # noqa: F401
from servers.redis import *  # noqa: F403 (its __all__: the Redis fixtures)
from servers.s3 import s3_server, s3_server_private  # noqa: F401
from servers.small_disk import small_disk  # noqa: F401
from servers.valkey import valkey_cluster, valkey_server, valkey_tls_certs, valkey_tls_server  # noqa: F401
