"""``kvgate put|get|stat|ls`` as subprocesses against the deployed gateway."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
from servers.proc import require_binary

from e2e.deployment import Deployment
from e2e.objects import bf16_tensor, unique

CLI_TIMEOUT = 60.0


async def kvgate(*args: str, url: str) -> tuple[int, bytes, str]:
    """``kvgate ARGS --url URL``: exit code, stdout, stderr (bounded by CLI_TIMEOUT)."""
    binary = require_binary("kvgate", "pip install -e '.[test]'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    proc = await asyncio.create_subprocess_exec(
        binary,
        *args,
        "--url",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out, err.decode(errors="replace")


async def test_the_cli_puts_gets_stats_and_lists(
    deployment: Deployment, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    url = deployment.gateway.url
    stem = unique("cli")
    by_http = bf16_tensor(f"{stem}-http", (2, 4, 32, 64), seed=3)
    by_cli = bf16_tensor(f"{stem}-cli", (2, 4, 32, 64), seed=4)
    await by_http.put(http)
    source = tmp_path / "chunk.bin"
    source.write_bytes(by_cli.data)
    target = tmp_path / "got.bin"
    shape = ",".join(map(str, by_cli.shape))
    # The commands run side by side (each pays for its own interpreter start); ``ls`` lists
    # the prefix of the object put over HTTP only, which no other command changes.
    put, got, stat, listed = await asyncio.gather(
        kvgate("put", by_cli.key, str(source), "--dtype", "bfloat16", "--shape", shape, url=url),
        kvgate("get", by_http.key, "-o", str(target), url=url),
        kvgate("stat", by_http.key, "--json", url=url),
        kvgate("ls", f"{stem}-ht", "--json", url=url),
    )
    for code, _, err in (put, got, stat, listed):
        assert code == 0, err
    assert target.read_bytes() == by_http.data
    info = json.loads(stat[1])
    assert info["size"] == len(by_http.data)
    assert (info["dtype"], tuple(info["shape"])) == ("bfloat16", by_http.shape)
    keys = json.loads(listed[1])["keys"]
    assert [k["key"] for k in keys] == [by_http.key]  # its size: memory's, or a lower frame's
    assert by_cli.served_by(await http.get(f"/v1/objects/{by_cli.key}"))
