"""The object routes' key parameter: the rest of the path, newlines included.

Starlette's ``{key:path}`` matches ``.*`` (then ``$``), and ``.`` does not match a newline:
a key with a ``%0A`` inside matched no route (the router's ``404 Not Found`` on PUT, GET, HEAD
and DELETE, where every other control character gets the key check's ``400 invalid_key``), and
a key *ending* in one matched without it (``$`` matches before a last newline): ``PUT
/v1/objects/k%0A`` overwrote ``k``. This converter matches any character, so every such key
reaches the key check.
"""

from __future__ import annotations

from starlette.convertors import Convertor, register_url_convertor


class _AnyCharacters(Convertor[str]):
    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("kvgate_key", _AnyCharacters())

KEY_PATH = "{key:kvgate_key}"
"""The key in an object route's path (``OBJECTS + KEY_PATH``)."""
