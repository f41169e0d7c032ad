"""``kvgate put|get|stat|ls``: objects of a running gateway, through its HTTP API.

These commands are thin clients of ``kvgate serve`` (``--url``, default ``$KVGATE_URL`` or
http://127.0.0.1:8080; ``--token`` or ``$KVGATE_TOKEN``). Bodies are streamed from and to files
in 1 MiB chunks, with a progress bar on stderr for large transfers when stderr is a terminal,
so stdout stays clean for payloads and ``--json``. Exit codes: 0 done, 1 no such object, 2 a
usage, configuration or authentication problem, or a local file that cannot be read or
written, 3 the gateway is unreachable or failed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat as stat_module
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any
from urllib.parse import quote, urlsplit

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from gateway.bearer import token_problem
from gateway.object_meta import MAX_POSITION

if TYPE_CHECKING:
    import httpx

DEFAULT_URL = "http://127.0.0.1:8080"
CHUNK = 1 << 20
PROGRESS_MIN = 16 << 20
"""Transfers below this size show no progress bar (they finish before one would help)."""
LIST_ROUTE = "/v1/keys"

err = Console(stderr=True, soft_wrap=True)  # a message stays one line, however long

Url = Annotated[str, typer.Option("--url", envvar="KVGATE_URL", help="the gateway's base URL")]
Token = Annotated[
    str | None,
    typer.Option("--token", envvar="KVGATE_TOKEN", help="bearer token", show_default=False),
]
MAX_TIMEOUT = 7 * 24 * 3600.0


def _check_timeout(value: float) -> float:
    # httpx refuses NaN, infinities and negative values with tracebacks of its own.
    if not 0 < value <= MAX_TIMEOUT:  # NaN fails this too
        raise typer.BadParameter(f"seconds, more than 0 and at most {MAX_TIMEOUT:.0f}")
    return value


Timeout = Annotated[float, typer.Option(help="seconds per request", callback=_check_timeout)]
AsJson = Annotated[bool, typer.Option("--json", help="metadata as one JSON object")]


def fail(message: str, code: int) -> typer.Exit:
    err.print(message, markup=False, highlight=False)
    return typer.Exit(code)


@contextlib.contextmanager
def client(url: str, token: str | None, timeout: float) -> Iterator[httpx.Client]:
    """An httpx client of the gateway; transport failures become exit code 3."""
    try:
        import httpx
    except ModuleNotFoundError:
        raise fail("these commands need httpx: pip install 'kvgate[gateway]'", 2) from None
    shown, parts = shown_url(url), urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise fail(f"{shown}: the gateway's URL starts with http:// or https://", 2)
    if "@" in parts.netloc:
        # httpx would send it as Basic auth in place of the bearer token, which the gateway
        # does not read, and it would show in every message.
        raise fail(
            f"{shown}: a user or password in the URL is not how the gateway authenticates: "
            "give the token with --token or KVGATE_TOKEN",
            2,
        )
    problem = token_problem(token) if token else None
    if problem is not None:  # the token is never shown
        raise fail(f"--token / KVGATE_TOKEN: {problem}", 2)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as http:
        try:
            yield http
        except httpx.TimeoutException:
            raise fail(f"{shown}: no answer within {timeout} s", 3) from None
        except httpx.LocalProtocolError as exc:  # never sent: a header value it cannot carry
            text = str(exc).replace(token, "***") if token else str(exc)
            raise fail(f"{shown}: a request this client cannot send: {text}", 2) from None
        except httpx.TransportError as exc:
            text = str(exc).replace(token, "***") if token else str(exc)
            raise fail(
                f"{shown}: cannot reach the gateway ({type(exc).__name__}: {text})", 3
            ) from None


def shown_url(url: str) -> str:
    """``url`` as messages show it: no password, and nothing before an ``@`` where there is
    no scheme to tell a user part from the rest (``user:pw@host``, ``//user:pw@host``)."""
    from gateway.config import redact_url

    if "://" in url:
        return redact_url(url)
    _, at, after = url.rpartition("@")
    return f"***@{after}" if at else url


def object_path(key: str) -> str:
    segment = quote(key, safe="")
    return "/v1/objects/" + (segment.replace(".", "%2E") if segment in (".", "..") else segment)


def check(response: httpx.Response, url: str, key: str | None = None) -> None:
    """Exit with a clear message unless the answer is a success."""
    status = response.status_code
    if status < 300:
        return
    url = shown_url(url)
    if status == 404 and key is not None:
        raise fail(f"no object {key!r}", 1)
    if status == 401:
        raise fail(f"{url}: unauthorized: give --token or set KVGATE_TOKEN", 2)
    with contextlib.suppress(Exception):
        response.read()
    try:
        body = response.json()
        detail = f"{body.get('error', '?')}: {body.get('detail', '')}"
    except (ValueError, AttributeError):
        detail = response.text[:200]
    raise fail(f"{url}: HTTP {status}: {detail}", 2 if status < 500 else 3)


def shape_list(text: str | None) -> list[int] | None:
    """A shape in its header form (``2,32,256,1024``) as ``--json`` prints it everywhere: a
    list of ints (ValueError when a part is not one)."""
    return [int(d) for d in text.split(",") if d.strip()] if text is not None else None


def metadata(response: httpx.Response, key: str) -> dict[str, Any]:
    h = response.headers
    size = h.get("content-length")
    return {
        "key": key,
        "size": int(size) if size is not None and size.isdigit() else None,
        "kind": h.get("x-kvgate-kind"),
        "dtype": h.get("x-kvgate-dtype"),
        "shape": shape_list(h.get("x-kvgate-shape")),
        "format": int(h["x-kvgate-format"]) if h.get("x-kvgate-format", "").isdigit() else None,
    }


def progress(total: int | None, what: str) -> Progress:
    show = err.is_terminal and total is not None and total >= PROGRESS_MIN
    return Progress(
        TextColumn(what),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=not show,
    )


def _chunks(source: IO[bytes], bar: Progress, task: Any) -> Iterator[bytes]:
    while chunk := source.read(CHUNK):
        bar.advance(task, len(chunk))
        yield chunk


def put(
    key: Annotated[str, typer.Argument(help="object key")],
    file: Annotated[str, typer.Argument(help="file to upload, or - for stdin")],
    dtype: Annotated[
        str | None, typer.Option(help="store as a tensor of this dtype (float16, bfloat16, ...)")
    ] = None,
    shape: Annotated[str | None, typer.Option(help="tensor shape, e.g. 2,32,256,1024")] = None,
    kind: Annotated[str | None, typer.Option(help="tensor, ndarray or bytes")] = None,
    fmt: Annotated[int | None, typer.Option("--format", help="LMCache memory format")] = None,
    ttl: Annotated[float | None, typer.Option(help="seconds until the object expires")] = None,
    position: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_POSITION,
            help="a KV chunk's first token index (kvtc undoes RoPE with it)",
        ),
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    timeout: Timeout = 300.0,
    as_json: AsJson = False,
) -> None:
    """Store FILE (or stdin) under KEY; with --dtype/--shape as a tensor."""
    if shape is not None and dtype is None:
        raise fail("--shape needs --dtype", 2)
    try:
        shape_dims = shape_list(shape)
    except ValueError:
        raise fail(f"--shape {shape!r}: comma-separated integers, e.g. 2,32,256,1024", 2) from None
    headers = {"content-type": "application/octet-stream"}
    for name, value in (("kind", kind), ("dtype", dtype), ("shape", shape), ("format", fmt)):
        if value is not None:
            headers[f"x-kvgate-{name}"] = str(value)
    if ttl is not None:
        headers["x-kvgate-ttl"] = str(ttl)
    if position is not None:
        headers["x-kvgate-position"] = str(position)
    with contextlib.ExitStack() as stack:
        source, size = _opened_source(file, stack)
        headers["content-length"] = str(size)
        http = stack.enter_context(client(url, token, timeout))
        bar = stack.enter_context(progress(size, f"put {key}"))
        task = bar.add_task("put", total=size)
        start = time.perf_counter()
        response = http.put(object_path(key), content=_chunks(source, bar, task), headers=headers)
        check(response, url)
    seconds = time.perf_counter() - start
    info = {"key": key, "size": size, "kind": kind or ("tensor" if dtype else "bytes"),
            "dtype": dtype, "shape": shape_dims, "seconds": round(seconds, 6)}  # fmt: skip
    if as_json:
        print(json.dumps(info))
    else:
        err.print(f"stored {key!r}: {size:,} bytes in {seconds:.3f} s", markup=False)


def _opened_source(file: str, stack: contextlib.ExitStack) -> tuple[IO[bytes], int]:
    """``file`` (``-``: stdin) open for reading, and its size, which the request must state
    before sending: a regular file is streamed, anything else (a pipe, a device, a process
    substitution) read whole first, as stdin is."""
    try:
        if file == "-":
            data = sys.stdin.buffer.read()
            return io.BytesIO(data), len(data)
        path = Path(file)
        if path.is_dir():
            raise fail(f"{file}: is a directory", 2)
        source = stack.enter_context(path.open("rb"))
        info = os.fstat(source.fileno())
        if stat_module.S_ISREG(info.st_mode):
            return source, info.st_size
        data = source.read()
        return io.BytesIO(data), len(data)
    except FileNotFoundError:
        raise fail(f"{file}: no such file", 2) from None
    except OSError as exc:
        raise fail(f"{file}: cannot read: {exc.strerror or exc}", 2) from None


def get(
    key: Annotated[str, typer.Argument(help="object key")],
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="file to write (default: stdout)")
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    timeout: Timeout = 300.0,
    as_json: AsJson = False,
) -> None:
    """Write the object's raw bytes to FILE or stdout (metadata with --json: stdout when -o
    is given, else stderr)."""
    to_file = output is not None and output != "-"
    target = _checked_target(output) if to_file and output is not None else None
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(client(url, token, timeout))
        response = stack.enter_context(http.stream("GET", object_path(key)))
        check(response, url, key)
        info = metadata(response, key)
        bar = stack.enter_context(progress(info["size"], f"get {key}"))
        task = bar.add_task("get", total=info["size"])
        chunks = response.iter_bytes(CHUNK)
        if target is None:
            _to_stdout(chunks, bar, task)
        else:
            _to_file(target, chunks, bar, task)
    if as_json:
        print(json.dumps(info), file=sys.stdout if to_file else sys.stderr)


def _checked_target(output: str) -> Path:
    """The file ``-o`` names, refused before anything is downloaded when it cannot be one."""
    target = Path(output)
    if target.is_dir():
        raise fail(f"{output}: is a directory; name the file to write", 2)
    if not target.parent.is_dir():
        raise fail(f"{output}: the folder {str(target.parent)!r} does not exist", 2)
    return target


def _to_file(target: Path, chunks: Iterator[bytes], bar: Progress, task: Any) -> None:
    """Write ``chunks`` beside ``target`` and rename over it: a reader never sees a
    half-written file, and a failure leaves neither a partial file nor a changed target."""
    partial: Path | None = None
    try:
        # A name of its own: two gets to one target never write into one partial file.
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        partial = Path(name)
        mask = os.umask(0)  # mkstemp makes it 0600; the file gets what open() would give it
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as sink:
            for chunk in chunks:
                sink.write(chunk)
                bar.advance(task, len(chunk))
        os.replace(partial, target)
    except OSError as exc:
        _remove(partial)
        raise fail(f"{target}: cannot write: {exc.strerror or exc}", 2) from None
    except BaseException:
        _remove(partial)
        raise


def _remove(partial: Path | None) -> None:
    if partial is not None:
        with contextlib.suppress(OSError):
            partial.unlink()


def _to_stdout(chunks: Iterator[bytes], bar: Progress, task: Any) -> None:
    sink = sys.stdout.buffer
    try:
        for chunk in chunks:
            sink.write(chunk)
            bar.advance(task, len(chunk))
        sink.flush()
    except BrokenPipeError:  # the reader stopped reading (``| head``): not an error here
        # Python would report the failed flush of stdout again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as exc:
        raise fail(f"stdout: cannot write: {exc.strerror or exc}", 2) from None


def stat(
    key: Annotated[str, typer.Argument(help="object key")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    timeout: Timeout = 30.0,
    as_json: AsJson = False,
) -> None:
    """Show an object's size, kind, dtype and shape (exit 1 if there is none)."""
    with client(url, token, timeout) as http:
        response = http.head(object_path(key))
        check(response, url, key)
    info = metadata(response, key)
    if as_json:
        print(json.dumps(info))
        return
    for name, value in info.items():
        if value is not None:
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            print(f"{name:7} {shown}")


def ls(
    prefix: Annotated[str, typer.Argument(help="list keys starting with this")] = "",
    limit: Annotated[int, typer.Option(min=1, help="at most this many keys")] = 1000,
    url: Url = DEFAULT_URL,
    token: Token = None,
    timeout: Timeout = 30.0,
    as_json: AsJson = False,
) -> None:
    """List keys (and sizes) starting with PREFIX, if the gateway can list."""
    found: list[dict[str, Any]] = []
    with client(url, token, timeout) as http:
        after: str | None = None
        while len(found) < limit:
            params: dict[str, Any] = {"prefix": prefix, "limit": min(1000, limit - len(found))}
            if after is not None:
                params["after"] = after
            response = http.get(LIST_ROUTE, params=params)
            if response.status_code in (404, 405):
                raise fail(
                    f"{url} cannot list keys: its HTTP API has no listing route "
                    f"(GET {LIST_ROUTE}?prefix=&limit=&after=)",
                    2,
                )
            check(response, url)
            page = response.json()
            found.extend(page.get("keys", []))
            after = page.get("next")
            if not after:
                break
    if as_json:
        print(json.dumps({"prefix": prefix, "keys": found[:limit]}))
        return
    for item in found[:limit]:
        print(f"{item.get('size', '?'):>12}  {item['key']}")


def register(app: typer.Typer) -> None:
    """Add put, get, stat and ls to the ``kvgate`` command."""
    for command in (put, get, stat, ls):
        app.command(command.__name__)(command)
