"""What a bearer token may be: what an HTTP header can carry, so a client can send it.

``kvgate serve`` refuses another token at start (no client could ever authenticate), and the
``kvgate`` object commands refuse it before sending (httpx would fail with the header, token
included, in its message). The token itself is never part of a message.
"""

from __future__ import annotations

SENDABLE = "visible ASCII characters (no spaces, control or non-ASCII characters)"


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token, or None when it can."""
    if not token:
        return "the token is empty"
    if not all("!" <= c <= "~" for c in token):
        return f"the token must be {SENDABLE}"
    return None
