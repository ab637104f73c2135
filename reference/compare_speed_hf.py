"""Decode and prefill speed of minikv's full cache against Hugging Face transformers, same
weights (the bundled SmolLM2 GGUF), same machine, same process, interleaved runs.

    reference/.venv-hf/bin/python reference/compare_speed_hf.py --prompt-tokens 500 --new-tokens 64

Run from the repository root with a Python that has transformers (it is never a dependency of
minikv). Greedy decoding, float32 on the CPU, EOS ignored, median of --repeats runs each.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minikv  # noqa: E402
from minikv.bench.common import text_ids  # noqa: E402
from minikv.loading import smollm2_gguf_path  # noqa: E402


def hf_run(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decoded token) with HF's own cache and greedy search."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True)
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return prefill, (time.perf_counter() - t1) / (new_tokens - 1)


def minikv_run(model, tok, ids: list[int], new_tokens: int) -> tuple[float, float]:
    stats = minikv.generate(model, tok, ids, max_new_tokens=new_tokens, stop_at_eos=False).stats
    return stats["ttft_s"], stats["tpot_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="also run minikv's compiled decode step")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tok = minikv.load("smollm2", device="cpu", dtype=torch.float32)
    models = {"minikv": model}
    if args.compile:  # the compiled decode step beside the eager one (minikv/fast/compiled.py)
        models["minikv-compiled"] = minikv.load("smollm2", device="cpu", dtype=torch.float32, compile=True)[0]
    ids = text_ids(tok, args.prompt_tokens)
    ids_t = torch.tensor([ids])
    hf_run(hf, ids_t, 4)  # warm-up
    for m in models.values():
        minikv_run(m, tok, ids, 4)
    runs = {"hf": [], **{name: [] for name in models}}
    for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
        runs["hf"].append(hf_run(hf, ids_t, args.new_tokens))
        for name, m in models.items():
            runs[name].append(minikv_run(m, tok, ids, args.new_tokens))
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
    import transformers

    print(f"SmolLM2-135M float32 CPU, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, prompt {args.prompt_tokens}, {args.new_tokens} new tokens")
    print(f"{'':<16} {'prefill s':>10} {'TPOT ms':>9} {'tok/s':>7}")
    for name, (pre, tpot) in med.items():
        print(f"{name:<16} {pre:>10.3f} {1000 * tpot:>9.2f} {1 / tpot:>7.1f}")
    for name in models:
        print(f"{name} / hf decode tokens/s: {med['hf'][1] / med[name][1]:.2f}x; "
              f"prefill speed: {med['hf'][0] / med[name][0]:.2f}x")


if __name__ == "__main__":
    main()
