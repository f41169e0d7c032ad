"""Access-log lines that never carry a secret a client put in the URL.

uvicorn's access log prints each request's path with its query string, so a client that sends
its token as ``?token=...`` or ``?access_token=...`` (as many HTTP clients can be told to) would
have it written to the log. kvgate reads tokens only from the ``Authorization`` header, which
no log prints; in a query string, only the parameters kvgate itself reads are kept
(``GET /v1/keys``'s ``prefix``, ``limit`` and ``after``), and every other parameter, name and
value, is printed as ``<redacted>``: a secret may travel under any name.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote_plus

ACCESS_LOGGER = "uvicorn.access"
KEPT_PARAMS = frozenset({"prefix", "limit", "after"})
REDACTED = "<redacted>"


def redact_query(target: str) -> str:
    """``target`` (a path and query string) with every parameter kvgate does not read hidden."""
    path, mark, query = target.partition("?")
    if not mark:
        return target
    kept = []
    for item in query.split("&"):
        name = unquote_plus(item.partition("=")[0])
        kept.append(item if name in KEPT_PARAMS else REDACTED)
    return f"{path}?{'&'.join(kept)}"


class RedactQuery(logging.Filter):
    """On uvicorn's access logger: redacts the query string of each logged request line.

    uvicorn logs ``'%s - "%s %s HTTP/%s" %d'`` with the client, method, path and query,
    HTTP version and status as arguments; the third is rewritten, nothing else is touched.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def redact_access_log() -> None:
    """Install ``RedactQuery`` on uvicorn's access logger, once per process."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQuery) for f in logger.filters):
        logger.addFilter(RedactQuery())
