"""azure:// beyond the conformance suite, against a real azurite server.

URLs and options, credentials (options, environment, wrong ones) and that no secret is ever
shown, staged blocks and ranged gets with small sizes, writers racing on staged blobs, faults
(a server killed mid-put, a stalled server against the timeout) and the raw-client baseline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
import uuid
from typing import Any

import pytest
from azure.storage.blob import BlobServiceClient
from servers.azurite import AzuriteServer

from connectors.azure import AzureConnector
from gateway.config import TierConfig
from gateway.errors import ConfigError, Timeout, Unavailable
from gateway.registry import connect
from gateway.testing import assert_same_bytes, digest, listed, make_bytes

MiB = 1 << 20
SMALL = {
    "put_threshold": 256 * 1024,
    "block_size": 256 * 1024,
    "ranged_get_threshold": 256 * 1024,
    "range_size": 256 * 1024,
    "max_concurrency": 4,
}


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def azure(server: AzuriteServer, prefix: str, **options: Any) -> AzureConnector:
    return AzureConnector.from_url(server.url(prefix), **server.options(**options))


def blob_names(server: AzuriteServer, prefix: str) -> dict[str, int]:
    service = BlobServiceClient.from_connection_string(server.connection_string)
    with service:
        container = service.get_container_client(server.container)
        return {b.name: b.size for b in container.list_blobs(name_starts_with=prefix)}


# -- options, URLs and secrets -----------------------------------------------------------------


def test_url_and_options_are_checked() -> None:
    conn = connect("azure://acct1/box/a/b", account_key="a2V5", endpoint="http://127.0.0.1:9/acct1")
    assert isinstance(conn, AzureConnector)
    assert (conn.location.account, conn.location.container) == ("acct1", "box")
    assert conn.location.prefix == "a/b/"
    assert AzureConnector.from_url("azure://acct1/box", sas_token="sv=1").location.prefix == ""
    bad: list[tuple[str, dict[str, Any]]] = [
        ("azure://acct1/box/p", {"account_key": "k", "no_such_option": 1}),
        ("azure://acct1/box/p", {"account_key": "k", "sas_token": "s"}),  # one credential
        ("azure://acct1/box/p", {"account_key": "k", "endpoint": "ftp://host"}),
        ("azure://user:pw@acct1/box/p", {"account_key": "k"}),
        ("azure://Acct_1/box/p", {"account_key": "k"}),  # account names: [a-z0-9]
        ("azure://acct1/x/p", {"account_key": "k"}),  # container too short
        ("azure://acct1/Box/p", {"account_key": "k"}),
        ("azure://acct1/box/a/../b", {"account_key": "k"}),
        ("azure://acct1/box/p?sig=x", {"account_key": "k"}),
        ("s3://acct1/box/p", {"account_key": "k"}),
    ]
    for url, options in bad:
        with pytest.raises(ConfigError):
            AzureConnector.from_url(url, **options)


def test_no_credential_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
    ):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="AZURE_STORAGE_CONNECTION_STRING"):
        AzureConnector.from_url("azure://acct1/box/p")


@pytest.mark.parametrize("option", ["account_key", "sas_token", "connection_string"])
def test_repr_config_and_errors_hide_the_secret(option: str) -> None:
    secret = f"s3cr3t{uuid.uuid4().hex}"
    value = f"AccountName=acct1;AccountKey={secret}" if option == "connection_string" else secret
    conn = AzureConnector.from_url("azure://acct1/box/p", **{option: value})
    for text in (repr(conn), repr(conn.options), str(conn.options)):
        assert secret not in text
    with pytest.raises(ConfigError) as err:
        AzureConnector.from_url("azure://acct1/box/p", bogus=1, **{option: value})
    assert secret not in str(err.value)
    # What `kvgate config` and the admin API print of a tier.
    tier = TierConfig.model_validate({"url": "azure://acct1/box/p", "options": {option: value}})
    assert secret not in str(tier.redacted())
    assert secret not in repr(tier)


async def test_a_wrong_key_is_a_config_error_that_hides_both_keys(
    azurite_server: AzuriteServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "d3Jvbmc" + uuid.uuid4().hex + "=="
    conn = azure(azurite_server, prefix, account_key=wrong)
    calls = {
        "get": lambda: conn.get("k"),
        "put": lambda: conn.put("k", b"v"),
        "exists": lambda: conn.exists("k"),
        "list": lambda: listed(conn, ""),
    }
    caplog.set_level(logging.DEBUG)
    try:
        for op, call in calls.items():
            with pytest.raises(ConfigError) as err:
                await call()
            message = str(err.value)
            assert "credential" in message, f"{op}: {message}"
            assert azurite_server.container in message
            for secret in (wrong, azurite_server.key):
                assert secret not in message, op
                assert secret not in caplog.text, op
    finally:
        await conn.close()


@pytest.mark.parametrize("variable", ["AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY"])
async def test_credentials_come_from_the_environment(
    azurite_server: AzuriteServer, prefix: str, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    if variable == "AZURE_STORAGE_CONNECTION_STRING":
        monkeypatch.setenv(variable, azurite_server.connection_string)
        options: dict[str, Any] = {}
    else:
        monkeypatch.setenv(variable, azurite_server.key)
        options = {"endpoint": azurite_server.endpoint}
    conn = AzureConnector.from_url(azurite_server.url(prefix), **options)
    try:
        await conn.put("k", b"from the environment")
        assert await conn.get("k") == b"from the environment"
    finally:
        await conn.close()


async def test_a_sas_token_works_and_is_never_logged(
    azurite_server: AzuriteServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    from datetime import UTC, datetime, timedelta

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    sas = generate_container_sas(
        azurite_server.account,
        azurite_server.container,
        account_key=azurite_server.key,
        permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    signature = dict(p.split("=", 1) for p in sas.split("&"))["sig"]
    caplog.set_level(logging.DEBUG)
    conn = AzureConnector.from_url(
        azurite_server.url(prefix), endpoint=azurite_server.endpoint, sas_token=sas
    )
    try:
        await conn.put("k", b"with a SAS")
        assert await conn.get("k") == b"with a SAS"
        assert await listed(conn, "") == {"k": 10}
        assert await conn.delete("k")
        assert not await conn.delete("k")
    finally:
        await conn.close()
    assert caplog.records, "the SDK logged nothing: the check below would be empty"
    assert signature not in caplog.text
    assert urllib.parse.unquote(signature) not in caplog.text


async def test_missing_container_is_named_or_created(azurite_server: AzuriteServer) -> None:
    container = f"kvgate-missing-{uuid.uuid4().hex[:8]}"
    url = f"azure://{azurite_server.account}/{container}/p"
    conn = AzureConnector.from_url(url, **azurite_server.options())
    try:
        for call in (lambda: conn.get("k"), lambda: conn.put("k", b"v"), conn.ping):
            with pytest.raises(ConfigError, match=container):
                await call()
    finally:
        await conn.close()
    conn = AzureConnector.from_url(url, **azurite_server.options(create_container=True))
    try:
        await conn.put("k", b"in a new container")
        assert await conn.get("k") == b"in a new container"
    finally:
        await conn.close()


# -- staged blocks and ranged gets ---------------------------------------------------------------


@pytest.mark.both_loops  # aiohttp under `kvgate serve`, which runs uvloop
async def test_staged_put_and_ranged_get_of_a_scatter_list(
    azurite_server: AzuriteServer, prefix: str
) -> None:
    conn = azure(azurite_server, prefix, **SMALL)
    pieces = [b"head", make_bytes(MiB, seed=1), bytearray(make_bytes(300_001, seed=2))]
    want = b"".join(pieces)
    slabs: list[bytearray] = []

    def alloc(n: int) -> memoryview:
        slabs.append(bytearray(n))
        return memoryview(slabs[-1])

    try:
        await conn.put("big", pieces)
        got = await conn.get_into("big", alloc)
        assert_same_bytes(got, want, "staged blob")
        assert [len(s) for s in slabs] == [len(want)]  # filled in place: the caller's buffer
        assert await listed(conn, "") == {"big": len(want)}
    finally:
        await conn.close()
    service = BlobServiceClient.from_connection_string(azurite_server.connection_string)
    with service:
        blob = service.get_blob_client(azurite_server.container, f"{prefix}/big.")
        committed, uncommitted = blob.get_block_list("all")
    assert len(committed) == 6  # 1.3 MiB in 256 KiB blocks
    assert not uncommitted


async def test_writers_racing_on_a_staged_blob_never_tear_it(
    azurite_server: AzuriteServer, prefix: str
) -> None:
    """Same offsets, same block count: with the SDK's offset-named blocks, one writer's
    commit could take another's blocks. Every read and the final blob must be one value."""
    conn = azure(azurite_server, prefix, **SMALL)
    values = [make_bytes(MiB, seed=50 + i) for i in range(6)]
    allowed = {digest(v) for v in values}
    outcomes: list[BaseException | None] = []

    async def write(value: bytes) -> None:
        try:
            await conn.put("contended", value)
            outcomes.append(None)
        except Unavailable as exc:  # the commit another writer's commit invalidated
            outcomes.append(exc)

    try:
        await conn.put("contended", values[0])
        await asyncio.gather(*(write(v) for v in values))
        assert any(o is None for o in outcomes), outcomes
        got = await conn.get("contended")
        assert got is not None
        assert digest(got) in allowed, "the blob is a mix of several writes"
    finally:
        await conn.close()


@pytest.mark.both_loops  # aiohttp under `kvgate serve`, which runs uvloop
async def test_a_cancelled_staged_put_leaves_the_old_blob(
    azurite_server: AzuriteServer, prefix: str
) -> None:
    conn = azure(azurite_server, prefix, **{**SMALL, "max_concurrency": 1})
    try:
        await conn.put("big", b"old")
        # 64 MiB: a quiet CI machine once staged and committed 8 MiB within the 0.2 s below.
        put = asyncio.create_task(conn.put("big", make_bytes(64 * MiB, seed=5)))
        await asyncio.sleep(0.2)  # some blocks are staged, none committed
        assert not put.done()
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert await conn.get("big") == b"old"
        assert blob_names(azurite_server, f"{prefix}/") == {f"{prefix}/big.": 3}
    finally:
        await conn.close()


# -- faults --------------------------------------------------------------------------------------


async def test_a_server_killed_mid_put_fails_the_put_and_the_connector_recovers(
    azurite_server_private: AzuriteServer, prefix: str
) -> None:
    server = azurite_server_private
    conn = azure(server, prefix, connect_timeout=0.5, read_timeout=2.0, **SMALL)
    try:
        await conn.put("k", b"before")
        put = asyncio.create_task(conn.put("big", make_bytes(64 * MiB, seed=3)))
        await asyncio.sleep(0.3)  # blocks are being staged
        assert not put.done()
        server.kill()
        start = time.monotonic()
        with pytest.raises(Unavailable):
            await put
        assert time.monotonic() - start < 5.0
        with pytest.raises(Unavailable):
            await conn.get("k")
        server.start()  # same port and account, empty (in memory)
        assert await conn.get("big") is None  # never a partial object
        await conn.put("big", make_bytes(MiB, seed=4))
        assert_same_bytes(await conn.get("big"), make_bytes(MiB, seed=4), "after the restart")
    finally:
        await conn.close()


async def test_a_stalled_server_times_out(
    azurite_server_private: AzuriteServer, prefix: str
) -> None:
    server = azurite_server_private
    conn = azure(server, prefix, request_timeout=0.5)
    try:
        await conn.put("k", b"v")
        with server.process.paused():
            for call in (lambda: conn.get("k"), lambda: conn.put("k", b"w"), conn.ping):
                start = time.monotonic()
                with pytest.raises(Timeout):
                    await call()
                assert time.monotonic() - start < 6.0  # 0.5 s against a pause with no end
        assert await conn.get("k") in (b"v", b"w")  # the server answers again
    finally:
        await conn.close()


async def test_raw_client_baseline_measures_and_cleans_up(azurite_server: AzuriteServer) -> None:
    url = azurite_server.url("baseline")
    put_gbps, get_gbps = await AzureConnector.raw_client_baseline(
        url,
        azurite_server.options(),
        size=256 * 1024,
        count=4,
        concurrency=2,
        payloads=[bytes([i]) * 256 * 1024 for i in range(3)],
    )
    assert put_gbps > 0
    assert get_gbps > 0
    assert blob_names(azurite_server, "baseline/") == {}
