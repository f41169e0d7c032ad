"""How many greedy tokens a lossy codec on kvgate's disk tier leaves as they were: vLLM loads a
prompt's KV that went through fp8 or KIVI-4, and its output is compared token by token with
the output of the uncompressed run. Information, not a test: a lossy codec may change them.

    python benchmarks/vllm/lossy.py [--tokens 64] [--prompt-tokens 2048]

Run with kvgate's venv; every vLLM process runs under ``.venv-vllm``'s python (see ttft.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ttft import prompt_of, run  # the same processes the TTFT benchmark runs

CODECS: dict[str, dict[str, Any]] = {
    "raw": {"codec": "raw"},
    "fp8": {"codec": "fp8"},
    "kivi-4": {"codec": "kivi", "codec_options": {"bits": 4, "group": 32}},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvgate-lossy-"))
    try:
        prompt = prompt_of(args.prompt_tokens, work)
        rows = []
        reference: list[int] | None = None
        for name, tier in CODECS.items():
            data = work / name
            extra = json.dumps(
                {
                    "kvgate_config": {
                        # No memory tier: the loading process reads what the codec wrote.
                        "tiers": [{"url": f"file://{data}", **tier}],
                        "staging": "1GiB",
                    }
                }
            )
            generated = ["--max-tokens", str(args.tokens), "--kvgate-extra", extra]
            computed = run(prompt, *generated)[0]
            loaded = run(prompt, *generated)[0]
            if reference is None:
                reference = computed["token_ids"]
            same = 0
            for a, b in zip(loaded["token_ids"], reference, strict=False):
                if a != b:
                    break
                same += 1
            rows.append((name, loaded["cached_tokens"], same, len(reference)))
        print("| codec on the disk tier | tokens loaded | leading output tokens as uncompressed |")
        print("|---|---|---|")
        for name, cached, same, total in rows:
            print(f"| {name} | {cached} | {same} of {total} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
