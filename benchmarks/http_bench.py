"""HTTP throughput of ``kvgate serve`` over loopback, next to a raw-socket baseline.

    python benchmarks/http_bench.py [--size 32MiB] [--count 16] [--small 1KiB]
                                    [--clients 64] [--seconds 3] [--json]

Starts ``kvgate serve`` (memory tier only, so the network path is what is measured) in a
subprocess, then:

1. PUT and GET ``count`` objects of ``size`` bytes, one at a time, with a minimal HTTP/1.1
   client on one keep-alive connection (sendall from one buffer, recv_into one preallocated
   buffer: the client costs next to nothing) -- both plain bytes and a uint8 tensor;
2. the same transfers against a raw-socket server (a subprocess that reads N bytes into a
   preallocated buffer, or writes N bytes from one): the ceiling of Python over loopback;
3. requests per second for ``small`` objects with ``clients`` concurrent connections
   (half PUTs, half GETs), for ``seconds`` each.

Numbers are noisy on a small shared machine: compare the two columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    low = text.strip().lower()
    for unit, mult in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * mult)
    return int(low)


# -- a minimal HTTP/1.1 client (blocking socket; one keep-alive connection) ---------------


class Http:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = b""

    def close(self) -> None:
        self.sock.close()

    def _head(self) -> tuple[int, dict[str, str]]:
        data = self.pending
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            data += chunk
        head, _, self.pending = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    def _body_into(self, out: memoryview) -> int:
        n = min(len(self.pending), out.nbytes)
        out[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        while n < out.nbytes:
            got = self.sock.recv_into(out[n:])
            if not got:
                raise ConnectionError("server closed the connection")
            n += got
        return n

    def request(
        self,
        method: str,
        path: str,
        body: memoryview | bytes = b"",
        headers: dict[str, str] | None = None,
        out: memoryview | None = None,
    ) -> int:
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if method in ("PUT", "POST"):
            lines.append(f"Content-Length: {len(body)}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        if len(body):
            self.sock.sendall(body)
        status, rh = self._head()
        length = int(rh.get("content-length", "0"))
        if method == "HEAD" or length == 0:
            return status
        if out is not None and out.nbytes >= length:
            self._body_into(out[:length])
        else:
            self._body_into(memoryview(bytearray(length)))
        return status


# -- raw-socket baseline server ----------------------------------------------------------


def raw_server(port: int, size: int) -> None:
    """Per request: an 9-byte command ``P<size u64>`` (read size bytes, ack 1 byte) or
    ``G<size u64>`` (write size bytes). Preallocated buffers both ways."""
    buf = memoryview(bytearray(size))
    with socket.create_server(("127.0.0.1", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                cmd = conn.recv(9, socket.MSG_WAITALL)
                if len(cmd) < 9:
                    return
                n = int.from_bytes(cmd[1:], "little")
                if cmd[:1] == b"P":
                    got = 0
                    while got < n:
                        got += conn.recv_into(buf[got:n])
                    conn.sendall(b"k")
                else:
                    conn.sendall(buf[:n])


def bench_raw(size: int, count: int, payload: memoryview) -> dict[str, float]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--raw-server", str(port), "--size", str(size)],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = memoryview(bytearray(size))
        with sock:
            start = time.perf_counter()
            for _ in range(count):
                sock.sendall(b"P" + size.to_bytes(8, "little"))
                sock.sendall(payload)
                sock.recv(1, socket.MSG_WAITALL)
            put = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(count):
                sock.sendall(b"G" + size.to_bytes(8, "little"))
                got = 0
                while got < size:
                    got += sock.recv_into(out[got:])
            get = time.perf_counter() - start
    finally:
        proc.wait(timeout=10)
    return {"put_gbps": size * count / put / 1e9, "get_gbps": size * count / get / 1e9}


# -- kvgate serve ------------------------------------------------------------------------


def start_gateway(tmp: Path, capacity: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cfg = tmp / "kvgate.yaml"
    cfg.write_text(f"tiers:\n  - url: 'memory://'\n    capacity: {capacity}\n")
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_TOKEN"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "-f",
            str(cfg),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--max-body",
            "1GiB",
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            http = Http(port)
            status = http.request("GET", "/readyz")
            http.close()
            if status == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("kvgate serve exited")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("kvgate serve did not become ready")


def bench_http(port: int, size: int, count: int, payload: memoryview) -> dict[str, float]:
    http = Http(port)
    out = memoryview(bytearray(size))
    result: dict[str, float] = {}
    kinds = {
        "bytes": {},
        "tensor": {"x-kvgate-dtype": "uint8", "x-kvgate-shape": str(size)},
    }
    try:
        for kind, headers in kinds.items():
            http.request("PUT", "/v1/objects/warm", payload, headers)  # warm both paths
            http.request("GET", "/v1/objects/warm", out=out)
            start = time.perf_counter()
            for i in range(count):
                status = http.request("PUT", f"/v1/objects/{kind}{i}", payload, headers)
                assert status == 204, status
            put = time.perf_counter() - start
            start = time.perf_counter()
            for i in range(count):
                status = http.request("GET", f"/v1/objects/{kind}{i}", out=out)
                assert status == 200, status
            get = time.perf_counter() - start
            assert out[:16] == payload[:16]
            result[f"{kind}_put_gbps"] = size * count / put / 1e9
            result[f"{kind}_get_gbps"] = size * count / get / 1e9
            for i in range(count):
                http.request("DELETE", f"/v1/objects/{kind}{i}")
    finally:
        http.close()
    return result


async def _small_rps(port: int, size: int, clients: int, seconds: float) -> dict[str, float]:
    body = os.urandom(size)
    put_head = (
        "PUT /v1/objects/s{i} HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(size) + "\r\n\r\n"
    )

    async def read_response(reader: asyncio.StreamReader) -> int:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":")[1]))
        return status

    async def client(i: int, method: str, until: float, counts: list[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < until:
                if method == "PUT":
                    writer.write(put_head.format(i=i).encode() + body)
                else:
                    writer.write(f"GET /v1/objects/s{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                status = await read_response(reader)
                assert status in (200, 204), status
                counts[0] += 1
        finally:
            writer.close()

    out: dict[str, float] = {}
    for method in ("PUT", "GET"):
        counts = [0]
        until = time.perf_counter() + seconds
        start = time.perf_counter()
        await asyncio.gather(*(client(i, method, until, counts) for i in range(clients)))
        out[f"small_{method.lower()}_rps"] = counts[0] / (time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="32MiB")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--small", default="1KiB")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = parse_size(args.size)
    if args.raw_server:
        raw_server(args.raw_server, size)
        return
    payload = memoryview(os.urandom(size))
    report: dict[str, Any] = {"size": size, "count": args.count}
    report["raw_before"] = bench_raw(size, args.count, payload)
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_gateway(Path(tmp), capacity=size * (args.count * 2 + 4))
        try:
            report["http"] = bench_http(port, size, args.count, payload)
            small = parse_size(args.small)
            report["small"] = asyncio.run(_small_rps(port, small, args.clients, args.seconds))
            report["small"].update(size=small, clients=args.clients)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    report["raw_after"] = bench_raw(size, args.count, payload)
    if args.json:
        print(json.dumps(report))
        return
    raw = {
        k: max(report["raw_before"][k], report["raw_after"][k]) for k in ("put_gbps", "get_gbps")
    }
    h = report["http"]
    mib = size / 2**20
    print(f"{args.count} x {mib:g} MiB over loopback, one connection (GB/s)")
    print(f"{'':18}{'PUT':>8}{'GET':>8}")
    print(f"{'raw socket':18}{raw['put_gbps']:8.2f}{raw['get_gbps']:8.2f}")
    for kind in ("bytes", "tensor"):
        print(f"{'http ' + kind:18}{h[kind + '_put_gbps']:8.2f}{h[kind + '_get_gbps']:8.2f}")
    s = report["small"]
    print(
        f"{s['size']} B objects, {s['clients']} clients: "
        f"PUT {s['small_put_rps']:,.0f} req/s, GET {s['small_get_rps']:,.0f} req/s"
    )


if __name__ == "__main__":
    main()
