"""kvpress's presses on the same task instances and weights as `python -m minikv.bench compare`,
written in the same JSON schema, so that `bench compare --include` puts them in the same tables.

    reference/.venv-kvpress/bin/python reference/compare_kvpress.py --threads 1 --json kvpress.json
    python -m minikv.bench compare --from compare/compare.json --include kvpress.json --out compare/

Run from the repository root with the kvpress virtualenv (reference/README.md; kvpress and
transformers are never dependencies of minikv). The model is the bundled SmolLM2 GGUF read by
transformers (float32, SDPA attention by default, the CPU); the prompts come from minikv's own generators
(minikv.bench.tasks), token for token. Per row, a press at the compression ratio that leaves
`budget` tokens per KV head of the prompt: ratio = 1 - budget / prompt tokens.

How a prompt runs (kvpress's own pipeline, with the whole prompt as its context): every prompt
token but the last is prefilled with the press active, which compresses the cache once; the last
token and the answer are then decoded greedily at their absolute positions (position_ids given,
as kvpress's pipeline does). Presses that act only at prefill leave the tokens generated after it
in the cache; the decoding-time row (Knorm at prefill, then kvpress's DecodingPress every 16
steps back to the budget) bounds them too. The long pass prefills --long-prompt tokens of
pydoc_data.topics the same way and feeds --long-steps more one at a time: time per step and the
perplexity of those tokens, against the same run's uncompressed row ("full").
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minikv.bench.compare import BUDGETS, PRESETS, task_haystacks  # noqa: E402
from minikv.bench.intervals import interval  # noqa: E402
from minikv.bench.common import text_ids  # noqa: E402
from minikv.bench.tasks import HAYSTACKS, make_instance, string_match_all, task_names  # noqa: E402
from minikv.loading import resolve, smollm2_gguf_path  # noqa: E402
from minikv.tokenizer import load_tokenizer  # noqa: E402

PRESSES = ["streaming_llm", "snapkv", "expected_attention", "tova", "knorm", "decoding_knorm"]


def make_press(name: str, ratio: float, budget: int):
    import kvpress as kp

    if name == "full":
        return None
    if name == "streaming_llm":  # StreamingLLM, kept keys re-rotated to contiguous positions
        return kp.KeyRerotationPress(press=kp.StreamingLLMPress(compression_ratio=ratio, n_sink=4))
    if name == "snapkv":
        return kp.SnapKVPress(compression_ratio=ratio)
    if name == "expected_attention":
        return kp.ExpectedAttentionPress(compression_ratio=ratio)
    if name == "tova":
        return kp.TOVAPress(compression_ratio=ratio)
    if name == "knorm":
        return kp.KnormPress(compression_ratio=ratio)
    if name == "decoding_knorm":
        return kp.PrefillDecodingPress(
            prefilling_press=kp.KnormPress(compression_ratio=ratio),
            decoding_press=kp.DecodingPress(base_press=kp.KnormPress(), compression_interval=16, target_size=budget,
                                            hidden_states_buffer_size=0))
    raise ValueError(f"unknown press {name!r}; presses: {', '.join(PRESSES)}")


def cache_tokens(cache) -> float:
    """Tokens per KV head held in the cache, mean over layers."""
    return sum(layer.keys.shape[-2] for layer in cache.layers) / len(cache.layers)


@torch.inference_mode()
def run_prompt(model, ids: list[int], press, new_tokens: int, eos: set[int], teacher: list[int] | None = None):
    """Greedy answer (or teacher-forced tokens) after a compressed prefill. Returns the new ids,
    the cache size after every forward, each decode step's seconds and the NLLs (teacher forcing)."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    cache, out_ids, sizes, times, nlls = DynamicCache(), [], [], [], []
    x = torch.tensor([ids])
    with press(model) if press is not None else nullcontext():
        model(input_ids=x[:, :-1], past_key_values=cache, use_cache=True)  # the press compresses here
        sizes.append(cache_tokens(cache))
        token, pos = x[:, -1:], len(ids) - 1
        steps = len(teacher) if teacher is not None else new_tokens
        for step in range(steps):
            t0 = time.perf_counter()
            logits = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[pos]]),
                           use_cache=True).logits[0, -1].float()
            times.append(time.perf_counter() - t0)
            sizes.append(cache_tokens(cache))
            if teacher is not None:
                nlls.append(float(torch.logsumexp(logits, 0) - logits[teacher[step]]))
                nxt = teacher[step]
            else:
                nxt = int(logits.argmax())
                out_ids.append(nxt)
                if nxt in eos:
                    break
            token, pos = torch.tensor([[nxt]]), pos + 1
    return out_ids, sizes, times, nlls


def run_row(model, tok, name: str, budget: int | None, instances, long_ids, settings) -> dict:
    row = {"source": "kvpress", "policy": name, "budget": budget, "error": None}
    scores, device, seq, answers = {}, [], [], []
    eos = set(tok.eos_ids)
    for inst in instances:
        ratio = 0.0 if budget is None else max(0.0, 1 - budget / (len(inst.ids) - 1))
        press = make_press(name, ratio, budget or 0)
        row["spec"] = repr(press) if press is not None else "no press"
        new, sizes, _, _ = run_prompt(model, inst.ids, press, inst.max_new_tokens, eos)
        text = tok.decode([t for t in new if t not in eos])
        score = string_match_all([text], [inst.answers])
        scores.setdefault(inst.key, []).append(score)
        answers.append({"task": inst.key, "seed": inst.seed, "haystack": inst.haystack, "answer": text, "score": score})
        device += sizes
        seq += [len(inst.ids) - 1 + k for k in range(len(sizes))]
        print(f"  {name} {budget} {inst.key} seed {inst.seed}: {score:.0f} {text.strip()[:40]!r}", file=sys.stderr,
              flush=True)
    if instances:
        row.update(scores={t: sum(v) / len(v) for t, v in scores.items()},
                   intervals={t: list(interval(v)) for t, v in scores.items()}, answers=answers,
                   kv_mean_tokens=sum(device) / len(device), kv_peak_tokens=max(device),
                   kv_share_mean=sum(device) / sum(seq), kv_share_peak=max(d / s for d, s in zip(device, seq)),
                   recall=None)
    if long_ids:
        n = settings["long_prompt"]
        ratio = 0.0 if budget is None else max(0.0, 1 - budget / (n - 1))
        _, sizes, times, nlls = run_prompt(model, long_ids[:n], make_press(name, ratio, budget or 0), 0, eos,
                                           teacher=long_ids[n:])
        peak = max(sizes)
        row["long"] = {"tpot_s": sum(times) / len(times), "ppl": math.exp(sum(nlls) / len(nlls)), "steps": len(times),
                       "device_tokens_peak": peak, "kv_share_peak": peak / len(long_ids)}
        print(f"  {name} {budget} long pass: TPOT {1000 * row['long']['tpot_s']:.1f} ms", file=sys.stderr, flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--press", nargs="+", default=PRESSES, help=f"presses (default all): {' '.join(PRESSES)}")
    p.add_argument("--budget", type=int, nargs="+", default=BUDGETS)
    p.add_argument("--tasks", nargs="+", help="task subset (default all, and the long pass: 'long')")
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--haystack", nargs="+", choices=HAYSTACKS, help="as bench compare's --haystack (preset's)")
    p.add_argument("--length", type=int)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                   help="transformers' attention (default sdpa; the presses score from queries and keys, "
                        "not from eager attention weights)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    tasks = args.tasks or task_names() + ["long"]
    settings = {"preset": args.preset, "tasks": tasks, "attn": args.attn, "budgets": args.budget, "chat": True,
                "length": args.length or preset["length"], "seeds": args.seeds or preset["seeds"],
                "haystacks": args.haystack or preset["haystacks"], "long_prompt": preset["long_prompt"], "long_steps": preset["long_steps"]}
    for name in args.press:
        make_press(name, 0.5, 64)  # an unknown press fails before the model loads

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(resolve("smollm2", progress=False))
    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation=args.attn).eval()
    instances = [make_instance(t, tok, settings["length"], s, haystack=h) for t in tasks if t != "long"
                 for h in task_haystacks(t, settings["haystacks"]) for s in settings["seeds"]]
    long_ids = text_ids(tok, settings["long_prompt"] + settings["long_steps"]) if "long" in tasks else None
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    result = {"benchmark": "compare", "source": "kvpress", "model": "smollm2 (GGUF via transformers)",
              "settings": settings, "rows": [], "oracle": {},
              "machine": {"cpu": cpu, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                          "transformers": transformers.__version__, "kvpress": kvpress.__version__
                          if hasattr(kvpress, "__version__") else "0.5.5", "python": platform.python_version()}}
    # budget by budget, every press at each: a run cut short still compares the presses
    for name, budget in [("full", None)] + [(n, b) for b in args.budget for n in args.press]:
        try:
            result["rows"].append(run_row(model, tok, name, budget, instances, long_ids, settings))
        except Exception as e:  # noqa: BLE001  a press that fails on this model is a row that says so
            result["rows"].append({"source": "kvpress", "policy": name, "budget": budget, "spec": name,
                                   "error": f"{type(e).__name__}: {e}"})
            print(f"  {name} {budget}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        Path(args.json).write_text(json.dumps(result, indent=1))  # partial results survive a crash
    return 0


if __name__ == "__main__":
    sys.exit(main())
