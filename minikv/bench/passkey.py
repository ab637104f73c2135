"""passkey: find a 5-digit pass key hidden in filler, per policy, length, depth and seed.

    python -m minikv.bench passkey --lengths 3000 --depths 0.1 0.5 0.9 --seeds 0 1 2 \\
        --policy full --policy streaming:R=1,slack=0,max_drop=0 --budget 256

The prompt (Mohtashami & Jaggi's landmark-attention test): an instruction, repeated filler
sentences, the key line "The pass key is 12345. Remember it. 12345 is the pass key." at
`depth` (0 = start, 1 = end) of the filler, then "What is the pass key? The pass key is". The
filler is cut so the whole prompt has --lengths tokens. Greedy decoding of --new-tokens tokens;
a trial succeeds when the first 5-digit number in the answer is the key. Seeds draw the key.
--budget N (repeatable) is given to every policy that takes a `budget` parameter and whose spec
does not set one (full keeps everything); each budget makes its own rows.
"""
from __future__ import annotations

import random
import re

from ..generate import generate
from ..policies import make
from ..policies.base import _REGISTRY, parameters
from .common import add_common_arguments, load_model, print_table, write_json

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def draw_key(seed: int) -> str:
    return str(random.Random(seed).randint(10000, 99999))


def needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


def build_prompt(tokenizer, length: int, depth: float, key: str) -> list[int]:
    """Token ids of exactly `length` tokens with the key line at `depth` of the filler."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    head, tail = tokenizer.encode(INSTRUCTION), tokenizer.encode(QUESTION, add_bos=False)
    line = tokenizer.encode(needle(key), add_bos=False)
    n_fill = length - len(head) - len(tail) - len(line)
    if n_fill < 0:
        raise ValueError(f"length {length} is shorter than the prompt without filler "
                         f"({len(head) + len(tail) + len(line)} tokens)")
    one = tokenizer.encode(FILLER, add_bos=False)
    filler = (one * (n_fill // len(one) + 1))[:n_fill]
    cut = round(depth * n_fill)
    return head + filler[:cut] + line + filler[cut:] + tail


def score(answer: str, key: str) -> bool:
    """The first 5-digit number of the answer is the key (a longer number does not count)."""
    found = re.search(r"(?<!\d)\d{5}(?!\d)", answer)
    return found is not None and found.group(0) == key


def with_budget(spec: str, budget: int | None) -> str:
    """spec plus budget=N when its policy takes a budget and the spec does not set one."""
    if budget is None:
        return spec
    name, _, rest = spec.partition(":")
    keys = {item.split("=")[0].strip() for item in rest.split(",") if item.strip()}
    if name not in _REGISTRY or "budget" not in parameters(_REGISTRY[name]) or "budget" in keys:
        return spec
    return f"{name}:{rest + ',' if rest else ''}budget={budget}"


def add_arguments(p) -> None:
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: full)")
    p.add_argument("--budget", type=int, action="append", help="budget for policies that take one, repeatable")
    p.add_argument("--lengths", type=int, nargs="+", default=[3000], help="prompt lengths in tokens (3000)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.5], help="key depths in [0, 1] (0.5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds drawing the key (0 1 2)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per answer (8)")
    add_common_arguments(p)


def run(args) -> int:
    model, tok = load_model(args)
    specs = []
    for spec in args.policy or ["full"]:
        for budget in args.budget or [None]:
            s = with_budget(spec, budget)
            make(s)  # fail on a bad spec before the first long prefill
            if s not in specs:
                specs.append(s)
    trials, rows = [], []
    for spec in specs:
        for length in args.lengths:
            for depth in args.depths:
                hits, mem = 0, []
                for seed in args.seeds:
                    key = draw_key(seed)
                    ids = build_prompt(tok, length, depth, key)
                    result = generate(model, tok, ids, policy=spec, max_new_tokens=args.new_tokens, stop_at_eos=False)
                    ok = score(result.text, key)
                    hits += ok
                    if "mem_percent" in result.stats:  # policies that report it (synckv)
                        mem.append(result.stats["mem_percent"])
                    trials.append({"policy": spec, "length": length, "depth": depth, "seed": seed, "key": key,
                                   "answer": result.text, "found": ok,
                                   "device_tokens_peak": result.stats["device_tokens_peak"]})
                    print(f"  {spec} length={length} depth={depth} seed={seed}: key {key}, "
                          f"answer {result.text!r} -> {'found' if ok else 'missed'}", flush=True)
                rows.append({"policy": spec, "length": length, "depth": depth, "found": hits,
                             "trials": len(args.seeds), "accuracy": hits / len(args.seeds),
                             "mem_percent": sum(mem) / len(mem) if mem else None})
    print_table(rows, [("policy", "policy", ""), ("length", "length", "d"), ("depth", "depth", ".2f"),
                       ("found", "found", "d"), ("trials", "trials", "d"), ("accuracy", "accuracy", ".2f"), ("Mem%", "mem_percent", ".1f")],
                title=f"\npasskey retrieval, {args.model}, greedy, {args.new_tokens} new tokens")
    write_json(args.json, {"benchmark": "passkey", "model": args.model, "rows": rows, "trials": trials})
    return 0
