"""Run under LMCache's python (``tests/servers/lmcache.py``): LMCache's own lm:// client puts
one KV chunk, then asks EXIST of that key and of ``kvgate-bench@1@0@5eed0002@<dtype>`` on the
same connection (LMCache's client has one), and prints one JSON object with the answers.

``test_lmserver.py`` points it at a kvgate server whose ``max_payload`` is below the chunk:
the PUT is dropped, and the connection must survive it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from lm_bench import _key, _lmcache_client  # LMCache's client, set up as the benchmark does


async def main(port: int, size_mib: int) -> dict[str, object]:
    conn, cpu, dtype = _lmcache_client(port, size_mib, "bfloat16")
    obj = cpu.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
    obj.tensor.fill_(1)
    await conn.put(_key(1, dtype), obj)  # no reply: LMCache does not know what became of it
    result = {
        "put_bytes": len(obj.byte_array),
        "exists_put": await conn.exists(_key(1, dtype)),
        "other_key": _key(2, dtype).to_string(),
        "exists_other": await conn.exists(_key(2, dtype)),
    }
    await conn.close()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--size-mib", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.port, args.size_mib))))
