"""``gateway://host:port`` and ``gateways://host:port``: another kvgate service as a tier.

Objects cross the network as kvgate frames (``application/vnd.kvgate.frame``), so a frame a
tier compressed stays compressed on the wire and the remote gateway stores a real object that
its own clients can read. See ``connector.py`` for the mapping of the Connector contract onto
the HTTP API.
"""

from connectors.gateway.connector import GatewayConnector

__all__ = ["GatewayConnector"]
