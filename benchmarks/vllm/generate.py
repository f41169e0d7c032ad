"""One vLLM process that generates greedily from a prompt, with kvgate's connector (or vLLM's
example connector, or none), and prints what happened as one JSON line (``RESULT {...}``).

    python benchmarks/vllm/generate.py --model DIR --prompt FILE [--prompt FILE ...]
        [--kvgate-extra JSON | --example-dir DIR] [--max-tokens 32] [--repeat 1]
        [--num-gpu-blocks N]

Run with the python of a venv that has vLLM (``.ci/vllm-env``). ``--repeat 2`` asks twice in
one process (vLLM's own prefix cache off, so the second request goes to the connector again).
Per request: prompt tokens, ``num_cached_tokens``, its wall time (with ``--max-tokens 1``, the
time to the first token), the greedy text. Several ``--prompt``s are sent together, as one batch;
``--num-gpu-blocks`` caps vLLM's KV cache (a small one makes vLLM preempt requests). The result
also gives vLLM's own counts of preemptions and of tokens its connector provided.
"""

from __future__ import annotations

import argparse
import json
import os
import time

for name, value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on the CPU
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(name, value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True, action="append")
    parser.add_argument("--kvgate-extra", help="kv_connector_extra_config for kvgate, JSON")
    parser.add_argument("--example-dir", help="vLLM's example connector, saving under DIR")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-gpu-blocks", type=int)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    transfer = None
    if args.kvgate_extra:
        transfer = {
            "kv_connector": "KvgateConnector",
            "kv_connector_module_path": "gateway.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": json.loads(args.kvgate_extra),
        }
    elif args.example_dir:
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": args.example_dir},
        }
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.repeat == 1,
        kv_transfer_config=transfer,
        disable_log_stats=False,  # for get_metrics
        **({"num_gpu_blocks_override": args.num_gpu_blocks} if args.num_gpu_blocks else {}),
    )
    startup = time.perf_counter() - started
    prompts = []
    for path in args.prompt:
        with open(path) as f:
            prompts.append(f.read())
    sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = []
    for _ in range(args.repeat):
        began = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        seconds = time.perf_counter() - began
        results += [
            {
                "prompt_tokens": len(out.prompt_token_ids or []),
                "cached_tokens": out.num_cached_tokens or 0,
                "seconds": seconds,
                "text": out.outputs[0].text,
                "token_ids": list(out.outputs[0].token_ids),
            }
            for out in outs
        ]
    counts = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    vllm_counts = {
        "preemptions": counts.get("vllm:num_preemptions"),
        "external_hits": counts.get("vllm:external_prefix_cache_hits"),
    }
    print(
        "RESULT " + json.dumps({"startup": startup, "requests": results, "vllm": vllm_counts}),
        flush=True,
    )


if __name__ == "__main__":
    main()
