"""The disk tier (``file://``): one file per object, written atomically, indexed at start.

``connector`` is the connector; ``record`` the on-disk record format; ``read`` its read
machinery (threads, buffered and O_DIRECT reads); ``dirs`` the directories it works in without
following a symlink; ``keylocks`` per-key ordering of its operations; ``snapshot`` the index
saved at a clean close and read at the next start.
"""

from connectors.fs.connector import FileConnector

__all__ = ["FileConnector"]
