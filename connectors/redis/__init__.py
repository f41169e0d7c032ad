"""Redis connectors (redis://, rediss://, unix://, redis+sentinel://, redis+cluster://).

See ``connectors.redis.connector`` for the design and ``connectors.redis.config`` for the URL
forms and options.
"""

from connectors.redis.connector import RedisConnector

__all__ = ["RedisConnector"]
