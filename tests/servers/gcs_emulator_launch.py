"""gcp-storage-emulator's own entry point, run as a script by ``gcs_emulator.py``, with three
changes that make it answer as GCS does where it did not:

- socketserver's listen backlog raised from 5, which reset the connections of a few dozen
  parallel requests;
- a media upload without a Content-Type is stored as application/octet-stream (GCS's
  default): the emulator stored none and answered ``"contentType": null``, which OpenDAL
  0.47's gcs writer refuses ("deserialize json: invalid type: null, expected a string");
- an empty media upload is an empty object: the emulator read its body as None and closed
  the connection without an answer (OpenDAL: "connection closed before message completed").

Nothing else of it is changed.
"""

from __future__ import annotations

import socketserver
import sys
from typing import Any

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.handlers import objects

socketserver.TCPServer.request_queue_size = 512

_content_type = objects._content_type_from_request
_read_data = server._read_data


def content_type_or_gcs_default(request: Any, default: str | None = None) -> str:
    return _content_type(request, default) or "application/octet-stream"


def empty_media_is_empty(request_handler: Any, query: dict[str, list[str]]) -> Any:
    data = _read_data(request_handler, query)
    if data is None and query.get("uploadType") == ["media"]:
        return b""
    return data


objects._content_type_from_request = content_type_or_gcs_default
server._read_data = empty_media_is_empty

if __name__ == "__main__":
    main(sys.argv[1:])
