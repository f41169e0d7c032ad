"""``kvgate put|get|stat|ls`` against a real kvgate service on loopback."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import typer
from servers.gateway_server import GatewayServer, gateway_server_at
from servers.proc import free_port
from typer.testing import CliRunner

from gateway.cli.objects import register


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    yield from gateway_server_at(tmp_path_factory.mktemp("gateway-cli"))


@pytest.fixture
def kvgate(server: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("KVGATE_URL", server.http_url)
    monkeypatch.delenv("KVGATE_TOKEN", raising=False)
    return CliRunner()


APP = typer.Typer()
register(APP)


def run(runner: CliRunner, *args: str, stdin: bytes | None = None) -> tuple[int, bytes, str]:
    result = runner.invoke(APP, list(args), input=stdin)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout_bytes, result.stderr


def test_put_then_get_a_file_and_stdin(kvgate: CliRunner, tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    src = tmp_path / "in.bin"
    src.write_bytes(data)
    code, out, _ = run(kvgate, "put", "cli/file", str(src), "--json")
    assert code == 0
    assert json.loads(out) == {
        "key": "cli/file", "size": len(data), "kind": "bytes", "dtype": None, "shape": None,
        "seconds": json.loads(out)["seconds"],
    }  # fmt: skip
    dst = tmp_path / "out.bin"
    code, out, _ = run(kvgate, "get", "cli/file", "-o", str(dst), "--json")
    assert code == 0
    assert dst.read_bytes() == data
    assert json.loads(out)["size"] == len(data)
    assert not list(tmp_path.glob(".*.part"))

    code, _, _ = run(kvgate, "put", "cli/stdin", "-", stdin=b"from stdin")
    assert code == 0
    code, out, _ = run(kvgate, "get", "cli/stdin")
    assert (code, out) == (0, b"from stdin")


def test_a_tensor_keeps_its_dtype_and_shape(kvgate: CliRunner, tmp_path: Path) -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.float16).reshape(2, 3, 4)
    src = tmp_path / "t.bin"
    src.write_bytes(arr.tobytes())
    args = ("put", "cli/tensor", str(src), "--dtype", "float16", "--shape", "2,3,4")
    assert run(kvgate, *args)[0] == 0
    code, out, err = run(kvgate, "get", "cli/tensor", "--json")
    assert code == 0
    assert np.array_equal(np.frombuffer(out, np.float16).reshape(2, 3, 4), arr)
    meta = json.loads(err.strip().splitlines()[-1])
    assert (meta["dtype"], meta["shape"], meta["size"]) == ("float16", [2, 3, 4], arr.nbytes)
    code, out, _ = run(kvgate, "stat", "cli/tensor", "--json")
    assert code == 0
    assert json.loads(out)["key"] == "cli/tensor"


def test_put_get_and_stat_print_the_shape_as_the_same_json_list(
    kvgate: CliRunner, tmp_path: Path
) -> None:
    src = tmp_path / "t.bin"
    src.write_bytes(np.zeros((2, 3, 4), np.float16).tobytes())
    args = ("put", "cli/shape", str(src), "--dtype", "float16", "--shape", "2,3,4", "--json")
    code, put_out, _ = run(kvgate, *args)
    assert code == 0
    code, _, get_err = run(kvgate, "get", "cli/shape", "--json")
    assert code == 0
    code, stat_out, _ = run(kvgate, "stat", "cli/shape", "--json")
    assert code == 0
    shapes = [json.loads(text)["shape"] for text in (put_out, get_err.splitlines()[-1], stat_out)]
    assert shapes == [[2, 3, 4]] * 3


def test_put_refuses_a_shape_that_is_not_integers_before_sending(kvgate: CliRunner) -> None:
    args = ("put", "cli/bad-shape", "-", "--dtype", "uint8", "--shape", "2,x")
    code, _, err = run(kvgate, *args, stdin=b"ab")
    assert code == 2
    assert "comma-separated integers" in err
    assert run(kvgate, "stat", "cli/bad-shape")[0] == 1


def test_missing_object_exits_1(kvgate: CliRunner) -> None:
    code, out, err = run(kvgate, "get", "cli/never-written")
    assert (code, out) == (1, b"")
    assert "no object 'cli/never-written'" in err
    assert run(kvgate, "stat", "cli/never-written")[0] == 1


def test_odd_keys_travel_as_one_path_segment(kvgate: CliRunner, tmp_path: Path) -> None:
    for i, key in enumerate(("a/b", "..", "a%2Fb", "ü 键")):
        assert run(kvgate, "put", key, "-", stdin=f"v{i}".encode())[0] == 0
    for i, key in enumerate(("a/b", "..", "a%2Fb", "ü 键")):
        assert run(kvgate, "get", key)[1] == f"v{i}".encode()


def test_ls_lists_keys_sorted_with_their_sizes(kvgate: CliRunner) -> None:
    for i in (3, 1, 2):
        assert run(kvgate, "put", f"ls/k{i}", "-", stdin=b"x" * i)[0] == 0
    assert run(kvgate, "put", "other/k", "-", stdin=b"y")[0] == 0
    code, out, _ = run(kvgate, "ls", "ls/", "--json")
    assert code == 0
    listed = json.loads(out)["keys"]
    assert listed == [{"key": f"ls/k{i}", "size": i} for i in (1, 2, 3)]
    code, out, _ = run(kvgate, "ls", "ls/", "--limit", "2")
    assert code == 0
    assert out.decode().split() == ["1", "ls/k1", "2", "ls/k2"]


def test_unreachable_gateway_exits_3(kvgate: CliRunner) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = run(kvgate, "get", "k", "--url", url)
    assert code == 3
    assert "cannot reach" in err


def test_a_password_in_the_url_is_refused_and_never_printed(kvgate: CliRunner) -> None:
    url = f"http://alice:S3CRET-PW@127.0.0.1:{free_port()}"
    code, out, err = run(kvgate, "get", "k", "--url", url, "--token", "t")
    assert code == 2
    assert "--token" in err
    assert "S3CRET-PW" not in err
    assert b"S3CRET-PW" not in out


@pytest.mark.parametrize("url", ["alice:S3CRET-PW@127.0.0.1:1", "//alice:S3CRET-PW@127.0.0.1:1"])
def test_a_url_without_a_scheme_is_refused_and_its_password_not_printed(
    kvgate: CliRunner, url: str
) -> None:
    code, out, err = run(kvgate, "stat", "k", "--url", url)
    assert code == 2
    assert "http://" in err
    assert "S3CRET-PW" not in err
    assert b"S3CRET-PW" not in out


def test_get_to_a_path_it_cannot_write_is_one_line_and_leaves_no_file(
    kvgate: CliRunner, tmp_path: Path
) -> None:
    assert run(kvgate, "put", "cli/out", "-", stdin=b"x" * 100_000)[0] == 0
    folder = tmp_path / "existing-folder"
    folder.mkdir()
    targets = {
        str(folder): "is a directory",
        str(tmp_path / "missing" / "x.bin"): "does not exist",
        "/proc/kvgate-test-output": "cannot write",
    }
    for target, why in targets.items():
        code, _, err = run(kvgate, "get", "cli/out", "-o", target)
        assert code == 2, (target, err)
        assert why in err
        assert len(err.strip().splitlines()) == 1, err  # a message, not a traceback
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["existing-folder"]  # no .part left


def test_get_o_dash_writes_stdout(kvgate: CliRunner, tmp_path: Path) -> None:
    assert run(kvgate, "put", "cli/dash", "-", stdin=b"to stdout")[0] == 0
    code, out, _ = run(kvgate, "get", "cli/dash", "-o", "-")
    assert (code, out) == (0, b"to stdout")


@pytest.mark.parametrize("token", ["my\nsecret-S3CRET", "secret-S3CRET-ü", "secret S3CRET"])
def test_a_token_no_header_can_carry_is_refused_unshown(kvgate: CliRunner, token: str) -> None:
    code, out, err = run(kvgate, "stat", "k", "--token", token)
    assert code == 2
    assert "visible ASCII" in err
    assert "S3CRET" not in err
    assert b"S3CRET" not in out


@pytest.mark.parametrize("timeout", ["-5", "0", "nan", "inf", "1e400"])
def test_a_timeout_out_of_range_is_a_usage_error(kvgate: CliRunner, timeout: str) -> None:
    code, _, err = run(kvgate, "stat", "k", "--timeout", timeout)
    assert code == 2
    assert "--timeout" in err


def test_put_reads_files_that_are_not_regular_and_refuses_folders(
    kvgate: CliRunner, tmp_path: Path
) -> None:
    code, _, err = run(kvgate, "put", "cli/null", "/dev/null")
    assert code == 0, err
    assert run(kvgate, "get", "cli/null")[:2] == (0, b"")
    code, _, err = run(kvgate, "put", "cli/folder", str(tmp_path))
    assert code == 2
    assert "is a directory" in err
    code, _, err = run(kvgate, "put", "cli/missing", str(tmp_path / "missing.bin"))
    assert code == 2
    assert "no such file" in err


def test_ls_limit_below_one_is_a_usage_error(kvgate: CliRunner) -> None:
    assert run(kvgate, "ls", "--limit", "0")[0] == 2


def test_get_to_a_full_stdout_or_a_closed_pipe(server: GatewayServer) -> None:
    """As a shell runs it: ``> /dev/full`` is one line and exit 2; ``| head -c 10`` (the
    reader closes the pipe) ends quietly, without Python's broken-pipe traceback."""
    binary = shutil.which("kvgate", path=str(Path(sys.executable).parent))
    assert binary is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    base = [binary]
    url = ["--url", server.http_url]
    put = subprocess.run(
        [*base, "put", "cli/pipe", "-", *url], input=b"z" * (4 << 20), env=env, check=False
    )
    assert put.returncode == 0
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [*base, "get", "cli/pipe", *url], stdout=full, stderr=subprocess.PIPE, env=env
        )
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines() == [
        "stdout: cannot write: No space left on device"
    ]
    shell = f"{shlex.join([*base, 'get', 'cli/pipe', *url])} | head -c 10 > /dev/null"
    piped = subprocess.run(
        ["bash", "-o", "pipefail", "-c", shell], stderr=subprocess.PIPE, env=env, timeout=60
    )
    assert piped.stderr == b""
    assert piped.returncode == 0
