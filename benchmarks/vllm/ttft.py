"""Time to first token with vLLM on this machine's CPU: recompute against a kvgate hit from the
worker's memory, from disk and through a gateway, next to vLLM's own example connector (files),
all in the same run, for prompts of about 1k to 8k tokens (SmolLM2's context is 8192).

    python benchmarks/vllm/ttft.py [--tokens 1024 2048 4096 8000] [--json]

Run with kvgate's venv (it starts ``kvgate serve``); every vLLM process runs under the python
of ``.venv-vllm`` (``.ci/vllm-env``). A "time to first token" is the wall time of a request
for one token, in a vLLM process already started (start-up is not counted). Each case:

- recompute: no connector;
- kvgate memory: one process asks twice (vLLM's own prefix cache off); the second request loads
  from the worker's memory tier;
- kvgate disk: a new process on the same kvgate config (memory + file): loads from the file tier;
- gateway: a process saves through ``gateway://`` (``kvgate serve``, memory + file), a new one
  loads through it;
- vLLM example: vLLM's ``ExampleConnector`` (safetensors files), saved then loaded by a new
  process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("INTEROP_VLLM_VENV") or ROOT / ".venv-vllm")
GENERATE = ROOT / "benchmarks" / "vllm" / "generate.py"
TEXTS = sorted(Path("/usr/share/common-licenses").glob("*"))
CHARS_PER_TOKEN = 4.2  # SmolLM2's tokenizer on license texts, measured here


def prompt_of(tokens: int, work: Path) -> Path:
    text = ""
    for path in TEXTS:
        if path.is_file():
            text += path.read_text(errors="replace")
        if len(text) > tokens * CHARS_PER_TOKEN:
            break
    path = work / f"prompt-{tokens}.txt"
    path.write_text(text[: int(tokens * CHARS_PER_TOKEN)])
    return path


def run(prompt: Path, *args: str, repeat: int = 1) -> list[dict[str, Any]]:
    command = [
        str(VENV / "bin" / "python"),
        str(GENERATE),
        "--model",
        str(VENV / "models" / "smollm2"),
        "--prompt",
        str(prompt),
        "--max-tokens",
        "1",
        "--max-model-len",
        "8192",  # SmolLM2's context
        "--repeat",
        str(repeat),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM failed ({done.returncode}):\n{done.stderr[-3000:]}")
    requests: list[dict[str, Any]] = json.loads(lines[-1][7:])["requests"]
    return requests


def kvgate_extra(data: Path) -> str:
    tiers = [{"url": "memory://", "capacity": "1GiB"}, {"url": f"file://{data}"}]
    return json.dumps({"kvgate_config": {"tiers": tiers, "prefault": False}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_gateway(work: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    config = work / "gateway.yaml"
    config.write_text(
        f"tiers:\n  - url: memory://\n    capacity: 1GiB\n  - url: file://{work / 'gw'}\n"
        "prefault: false\n"
    )
    kvgate = Path(sys.executable).with_name("kvgate")
    proc = subprocess.Popen(
        [str(kvgate), "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kvgate serve did not start")


def measure(tokens: int, work: Path) -> dict[str, Any]:
    """One prompt length, every case; a case whose vLLM process fails is recorded as an error
    (its last stderr line) and the others still run."""
    prompt = prompt_of(tokens, work)
    row: dict[str, Any] = {}

    def case(name: str, loaded: Callable[[], dict[str, Any]]) -> None:
        try:
            result = loaded()
        except RuntimeError as exc:
            row[name], row[f"{name}_cached"] = None, None
            row[f"{name}_error"] = str(exc).strip().splitlines()[-1][:300]
            return
        row[name], row[f"{name}_cached"] = result["seconds"], result["cached_tokens"]
        row["prompt_tokens"] = result["prompt_tokens"]

    case("recompute", lambda: run(prompt)[0])
    data = work / f"kvgate-{tokens}"
    # The second request of one process: vLLM's own prefix cache is off, so it loads from the
    # worker's memory tier (while the first request's saves may still be written to disk).
    case("kvgate_memory", lambda: run(prompt, "--kvgate-extra", kvgate_extra(data), repeat=2)[1])
    case("kvgate_disk", lambda: run(prompt, "--kvgate-extra", kvgate_extra(data))[0])
    gateway, port = start_gateway(work / f"gw-{tokens}")
    try:
        extra = json.dumps({"kvgate_url": f"gateway://127.0.0.1:{port}", "local_memory": "1GiB"})

        def through_gateway() -> dict[str, Any]:
            run(prompt, "--kvgate-extra", extra)
            return run(prompt, "--kvgate-extra", extra)[0]

        case("gateway", through_gateway)
    finally:
        gateway.terminate()
        gateway.wait(30)
    files = work / f"example-{tokens}"

    def example() -> dict[str, Any]:
        run(prompt, "--example-dir", str(files))
        return run(prompt, "--example-dir", str(files))[0]

    case("vllm_example", example)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvgate-ttft-"))
    rows = []
    try:
        for tokens in args.tokens:
            (work / f"gw-{tokens}").mkdir()
            rows.append(measure(tokens, work))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
        return
    cases = ("recompute", "kvgate_memory", "kvgate_disk", "gateway", "vllm_example")
    print("| prompt tokens | recompute | kvgate memory | kvgate disk | gateway | vLLM example |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = []
        for name in cases:
            if r.get(name) is None:
                cells.append("failed")
            elif name == "recompute":
                cells.append(f"{r[name]:.2f} s")
            else:
                cells.append(f"{r[name]:.2f} s ({r[f'{name}_cached']} loaded)")
        print(f"| {r.get('prompt_tokens', '?')} | {' | '.join(cells)} |")
    for r in rows:
        for name in cases:
            if f"{name}_error" in r:
                print(f"{r.get('prompt_tokens', '?')} tokens, {name}: {r[f'{name}_error']}")


if __name__ == "__main__":
    main()
