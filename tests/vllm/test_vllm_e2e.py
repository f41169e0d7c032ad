"""vLLM (on the CPU, with a real model: SmolLM2-135M-Instruct) saving to and loading from kvgate
through ``KvgateConnector``, one vLLM process after another, as users run it.

vLLM lives in its own venv (``.ci/vllm-env``: ``.venv-vllm``, or ``INTEROP_VLLM_VENV``);
missing, these tests skip on a developer machine and FAIL in CI. Each process is
``benchmarks/vllm/generate.py`` under that venv's python (about 30-60 s each here). Asserted:
counts and text, never times.

- A generates from an ~800-token prompt with a kvgate config (memory + disk); a new process B
  with the same prompt loads at least 90% of it from kvgate and generates the same greedy text;
- with every stored chunk corrupted on disk, a new process recomputes (kvgate's checksums
  turn the chunks into misses at lookup) and still generates the same text;
- the same through a running gateway (``kvgate serve``) whose disk tier compresses with zstd;
- a batch in a KV cache too small for it, so that vLLM preempts a request and resumes it: the
  chunks it saved are loaded into its new blocks, and every text is the text without kvgate.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.serve import Kvgate, kvgate_serve
from servers.proc import in_ci

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ROOT / "benchmarks" / "vllm" / "generate.py"
PROMPT_SOURCE = Path("/usr/share/common-licenses/GPL-3")  # on every Debian system
RUN_LIMIT_S = 600.0


def vllm_venv() -> Path:
    venv = Path(os.environ.get("INTEROP_VLLM_VENV") or ROOT / ".venv-vllm")
    if (venv / "models" / "smollm2" / ".converted").exists():
        return venv
    message = f"vLLM and its model are not set up in {venv} (run .ci/vllm-env)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 800 tokens of text, then an instruction."""
    if not PROMPT_SOURCE.exists():
        pytest.fail(f"{PROMPT_SOURCE} is missing (Debian's base-files ship it)")
    path = tmp_path_factory.mktemp("vllm") / "prompt.txt"
    text = PROMPT_SOURCE.read_text()[:3500]
    path.write_text(text + "\n\nSummarize the text above in one sentence:")
    return path


def generate(prompt: Path, extra: dict[str, Any], work: Path) -> dict[str, Any]:
    """One vLLM process, one greedy request: what it reported."""
    result: dict[str, Any] = run_generate(["--prompt", str(prompt)], extra, work)["requests"][0]
    return result


def run_generate(
    args: list[str], extra: dict[str, Any] | None, work: Path, *, log_info: bool = False
) -> dict[str, Any]:
    """One vLLM process (``generate.py ARGS``, with kvgate's connector unless ``extra`` is
    None): its whole result, and under ``"log"`` what vLLM logged (at INFO with
    ``log_info``; vLLM logs to stdout, kvgate's connector through vLLM's logger)."""
    venv = vllm_venv()
    command = [
        str(venv / "bin" / "python"),
        str(GENERATE),
        "--model",
        str(venv / "models" / "smollm2"),
        *args,
        *(["--kvgate-extra", json.dumps(extra)] if extra is not None else []),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "VLLM_"))}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's kvgate, whatever the venv was made from
    if log_info:
        env["VLLM_LOGGING_LEVEL"] = "INFO"
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_LIMIT_S, env=env, cwd=work
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0, f"vLLM exited {done.returncode}:\n{done.stderr[-4000:]}"
    assert lines, f"vLLM printed no result:\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    result["log"] = done.stdout
    return result


def local(data: Path) -> dict[str, Any]:
    tiers = [{"url": "memory://", "capacity": "256MiB"}, {"url": f"file://{data}"}]
    return {"kvgate_config": {"tiers": tiers, "prefault": False}}


def stored_chunks(data: Path) -> list[Path]:
    return sorted((data / "objects").rglob("*.kvo"))


@pytest.fixture(scope="module")
def first(prompt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """Process A: computes everything and saves its chunks."""
    work = tmp_path_factory.mktemp("vllm-a")
    data = work / "kvgate"
    result = generate(prompt, local(data), work)
    return result, data


def test_a_new_process_loads_the_prefix_and_generates_the_same_text(
    prompt: Path, first: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    computed, data = first
    assert computed["cached_tokens"] == 0
    assert computed["prompt_tokens"] >= 700
    assert len(stored_chunks(data)) == computed["prompt_tokens"] // 256
    loaded = generate(prompt, local(data), tmp_path)
    assert loaded["cached_tokens"] >= 0.9 * loaded["prompt_tokens"]
    assert loaded["text"] == computed["text"]
    assert loaded["text"].strip()


def test_corrupted_chunks_are_recomputed_and_the_text_stays(
    prompt: Path, first: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    computed, data = first
    chunks = stored_chunks(data)
    assert chunks
    for chunk in chunks:  # one byte of each chunk's payload flipped
        blob = bytearray(chunk.read_bytes())
        blob[len(blob) // 2] ^= 0x5A
        chunk.write_bytes(bytes(blob))
    recomputed = generate(prompt, local(data), tmp_path)
    assert recomputed["cached_tokens"] == 0
    assert recomputed["text"] == computed["text"]
    # The recomputation saved good chunks again: a next process loads them.
    again = generate(prompt, local(data), tmp_path)
    assert again["cached_tokens"] >= 0.9 * again["prompt_tokens"]
    assert again["text"] == computed["text"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvgate]:
    root = tmp_path_factory.mktemp("vllm-gateway")
    config = root / "kvgate.yaml"
    config.write_text(
        "tiers:\n  - url: memory://\n    capacity: 256MiB\n"
        f"  - url: file://{root / 'data'}\n    codec: zstd\nprefault: false\n"
    )
    served = kvgate_serve(root, config=config, env={"KVGATE_DATA_DIR": str(root / "unused")})
    try:
        yield served.start()
    finally:
        served.stop()
        shutil.rmtree(root / "data", ignore_errors=True)


def test_through_a_gateway_with_a_lossless_codec(
    prompt: Path, first: tuple[dict[str, Any], Path], gateway: Kvgate, tmp_path: Path
) -> None:
    computed, _ = first
    extra = {"kvgate_url": f"gateway://127.0.0.1:{gateway.port}", "local_memory": "128MiB"}
    saved = generate(prompt, extra, tmp_path)
    assert saved["cached_tokens"] == 0
    assert saved["text"] == computed["text"]
    loaded = generate(prompt, extra, tmp_path)
    assert loaded["cached_tokens"] >= 0.9 * loaded["prompt_tokens"]
    assert loaded["text"] == computed["text"]


def test_a_preempted_request_resumes_from_its_chunks_with_the_same_text(tmp_path: Path) -> None:
    """Three prompts (~800, ~600, ~600 tokens) of 200 greedy tokens each in 18 blocks of 128
    tokens: vLLM preempts one, and when it resumes asks the connector again, which loads the
    chunks that request saved during its prefill. The texts must be those of the same run
    without kvgate (a load planned and never sent made vLLM compute over blocks nobody wrote:
    a different text, no error)."""
    text = PROMPT_SOURCE.read_text()
    prompts = []
    for i, (start, end) in enumerate(((0, 3500), (4000, 6600), (7000, 9600))):
        path = tmp_path / f"p{i}.txt"
        path.write_text(text[start:end])  # the model goes on with the text: 200 tokens
        prompts += ["--prompt", str(path)]
    args = [*prompts, "--max-tokens", "200", "--num-gpu-blocks", "18"]
    memory = {"kvgate_config": {"tiers": [{"url": "memory://", "capacity": "512MiB"}]}}
    without = run_generate(args, None, tmp_path)
    with_kvgate = run_generate(args, memory, tmp_path, log_info=True)
    assert with_kvgate["vllm"]["preemptions"], "vLLM preempted nothing: the test tests nothing"
    # A fresh store holds nothing but what this run saved, so what was loaded was loaded for
    # the resumed request (vLLM counts those hits apart, outside its metrics: the connector's
    # own count at shutdown, in vLLM's log, says it).
    loaded = re.findall(r"kvgate: (\d+) chunks loaded, (\d+) not loaded", with_kvgate["log"])
    assert loaded, "the connector's counts are not in vLLM's log"
    assert int(loaded[-1][0]) >= 1, "no chunk was loaded for the resumed request"
    assert int(loaded[-1][1]) == 0
    texts = [r["text"] for r in with_kvgate["requests"]]
    assert texts == [r["text"] for r in without["requests"]]
    assert all(t.strip() for t in texts)
