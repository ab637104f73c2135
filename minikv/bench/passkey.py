"""passkey: find a 5-digit pass key hidden in filler, per policy, length, depth and seed.

    python -m minikv.bench passkey --lengths 3000 --depths 0.1 0.5 0.9 --seeds 0 1 2 \\
        --policy full --policy streaming:R=1,slack=0,max_drop=0 --budget 256

The prompt (Mohtashami & Jaggi's landmark-attention test): an instruction, repeated filler
sentences, the key line "The pass key is 12345. Remember it. 12345 is the pass key." at
`depth` (0 = start, 1 = end) of the filler, then "What is the pass key? The pass key is". The
filler is cut so the whole prompt has --lengths tokens. `--filler pydoc` replaces the repeated
sentences with natural text (the standard library's pydoc_data documentation, from its start):
repetition makes every filler page look alike, which flatters page-level retrieval.
Greedy decoding of --new-tokens tokens;
a trial succeeds when the first 5-digit number in the answer is the key. Seeds draw the key.
--budget N (repeatable) is given to every policy that takes a `budget` parameter and whose spec
does not set one (full keeps everything); each budget makes its own rows.

--shared-prefill runs each prompt's prefill forward once for all policies (shared_prefill.py:
each policy's layers store the prompt's KV from the same forward; a policy whose prefill output
differs, checked layer by layer, is prefilled on its own), then decodes each policy on its own.
The answers are those of separate runs; the prefills, which dominate at thousands of tokens,
cost one forward instead of one per policy.

stdout: a table with a row per policy, length and depth, then one per policy and length over all
depths. stderr: a line per trial as it ends.
"""
from __future__ import annotations

import gc
import random
import re
import sys
from functools import lru_cache

import torch

from ..generate import decode_n_tokens, generate
from ..policies import make
from ..policies.registry import _REGISTRY, parameters
from .common import add_common_arguments, load_model, print_table, write_json
from .shared_prefill import shared_prefill

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def draw_key(seed: int) -> str:
    return str(random.Random(seed).randint(10000, 99999))


def needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


FILLERS = ("repeat", "pydoc")


@lru_cache(maxsize=4)
def _pydoc_tokens(tokenizer) -> tuple[int, ...]:
    from pydoc_data.topics import topics

    return tuple(tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_bos=False))


def filler_tokens(tokenizer, n: int, filler: str = "repeat", start: float = 0.0) -> list[int]:
    """n filler tokens: the repeated sentences, or natural text (pydoc_data, ~100k tokens) from
    `start` (a fraction of the text before which it begins, so different prompts read different
    text)."""
    if filler == "repeat":
        one = tokenizer.encode(FILLER, add_bos=False)
        return (one * (n // len(one) + 1))[:n]
    if filler == "pydoc":
        text = _pydoc_tokens(tokenizer)
        if n > len(text):
            raise ValueError(f"the pydoc filler holds {len(text)} tokens, {n} were asked for")
        at = int(start * (len(text) - n))
        return list(text[at:at + n])
    raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")


def build_prompt(tokenizer, length: int, depth: float, key: str, filler: str = "repeat", start: float = 0.0) -> list[int]:
    """Token ids of exactly `length` tokens with the key line at `depth` of the filler."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    head, tail = tokenizer.encode(INSTRUCTION), tokenizer.encode(QUESTION, add_bos=False)
    line = tokenizer.encode(needle(key), add_bos=False)
    n_fill = length - len(head) - len(tail) - len(line)
    if n_fill < 0:
        raise ValueError(f"length {length} is shorter than the prompt without filler "
                         f"({len(head) + len(tail) + len(line)} tokens)")
    fill = filler_tokens(tokenizer, n_fill, filler, start)
    cut = round(depth * n_fill)
    return head + fill[:cut] + line + fill[cut:] + tail


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


def shared_trials(model, tok, specs: list[str], ids: list[int], new_tokens: int) -> dict[str, dict]:
    """Prefill once for all specs, decode each greedily -> {spec: {"text", "stats"}}."""
    gc.collect()  # a policy and its layers point at each other: free the last prompt's caches first
    def bind(j):
        return make(specs[j]).bind(model.cfg, device=model.device, dtype=model.dtype, max_len=len(ids) + new_tokens)

    policies = [bind(j) for j in range(len(specs))]
    logits = shared_prefill(model, ids, policies, rebind=bind)
    lengths = torch.tensor([len(ids)], device=model.device)
    found = {}
    for spec, policy, first in zip(specs, policies, logits):
        new = decode_n_tokens(model, first, lengths, policy, new_tokens, set(), (0.0, None, None), None)
        found[spec] = {"text": tok.decode(new[0]), "stats": policy.stats()}
    return found


def over_depths(rows: list[dict]) -> list[dict]:
    """Rows per (policy, length) summed over depths, in first-seen order."""
    totals: dict[tuple, dict] = {}
    for r in rows:
        t = totals.setdefault((r["policy"], r["length"]), {"policy": r["policy"], "length": r["length"],
                                                           "found": 0, "trials": 0})
        t["found"] += r["found"]
        t["trials"] += r["trials"]
    for t in totals.values():
        t["accuracy"] = t["found"] / t["trials"]
    return list(totals.values())


def add_arguments(p) -> None:
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: full)")
    p.add_argument("--budget", type=int, action="append", help="budget for policies that take one, repeatable")
    p.add_argument("--lengths", type=int, nargs="+", default=[3000], help="prompt lengths in tokens (3000)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.5], help="key depths in [0, 1] (0.5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds drawing the key (0 1 2)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per answer (8)")
    p.add_argument("--filler", choices=FILLERS, default="repeat",
                   help="repeat: the test's repeated sentences; pydoc: natural text (default repeat)")
    p.add_argument("--shared-prefill", action="store_true",
                   help="one prefill forward per prompt for the policies whose prefills agree")
    add_common_arguments(p)


def policy_specs(args) -> list[str]:
    specs = []
    for spec in args.policy or ["full"]:
        for budget in args.budget or [None]:
            s = with_budget(spec, budget)
            make(s)  # fail on a bad spec before the model loads
            if s not in specs:
                specs.append(s)
    return specs


def check(args) -> None:
    """The flags that need no model (python -m minikv.bench calls this before loading it)."""
    for depth in args.depths:
        if not 0 <= depth <= 1:
            raise ValueError(f"--depths: a depth is in [0, 1] (0 = start, 1 = end of the filler), got {depth}")
    for name, values in (("--lengths", args.lengths), ("--budget", args.budget or [])):
        if any(v < 1 for v in values):
            raise ValueError(f"{name} must be >= 1, got {min(values)}")
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    policy_specs(args)


def run(args) -> int:
    check(args)
    specs = policy_specs(args)
    model, tok = load_model(args)
    context = model.cfg.max_position_embeddings
    for length in args.lengths:  # every length, before the first trial of the first
        if length + args.new_tokens > context:
            raise ValueError(f"--lengths {length} + --new-tokens {args.new_tokens} exceeds the model's context of "
                             f"{context} tokens")
        build_prompt(tok, length, args.depths[0], draw_key(0), args.filler)  # too short for the instruction and key?
    trials, answers = [], {}
    for length in args.lengths:
        for depth in args.depths:
            for seed in args.seeds:
                key = draw_key(seed)
                ids = build_prompt(tok, length, depth, key, args.filler)
                if args.shared_prefill:
                    found = shared_trials(model, tok, specs, ids, args.new_tokens)
                else:
                    found = {}
                    for spec in specs:
                        r = generate(model, tok, ids, policy=spec, max_new_tokens=args.new_tokens, stop_at_eos=False)
                        found[spec] = {"text": r.text, "stats": r.stats}
                for spec in specs:
                    text = found[spec]["text"]
                    ok = score(text, key)
                    answers[spec, length, depth, seed] = ok
                    trials.append({"policy": spec, "length": length, "depth": depth, "seed": seed, "key": key,
                                   "answer": text, "found": ok,
                                   "device_tokens_peak": found[spec]["stats"]["device_tokens_peak"],
                                   # device KV as a share of full KV, for policies that report it (synckv)
                                   "mem_percent": found[spec]["stats"].get("mem_percent")})
                    print(f"  {spec} length={length} depth={depth} seed={seed}: key {key}, "
                          f"answer {text!r} -> {'found' if ok else 'missed'}", file=sys.stderr, flush=True)
    rows = []
    for spec in specs:
        for length in args.lengths:
            for depth in args.depths:
                hits = sum(answers[spec, length, depth, seed] for seed in args.seeds)
                mem = [t["mem_percent"] for t in trials if t["mem_percent"] is not None
                       and (t["policy"], t["length"], t["depth"]) == (spec, length, depth)]
                rows.append({"policy": spec, "length": length, "depth": depth, "found": hits,
                             "trials": len(args.seeds), "accuracy": hits / len(args.seeds),
                             "mem_percent": sum(mem) / len(mem) if mem else None})
    print_table(rows, [("policy", "policy", ""), ("length", "length", "d"), ("depth", "depth", ".2f"),
                       ("found", "found", "d"), ("trials", "trials", "d"), ("accuracy", "accuracy", ".2f"),
                       ("Mem%", "mem_percent", ".1f")],
                title=f"passkey retrieval, {args.model}, greedy, {args.new_tokens} new tokens")
    totals = over_depths(rows)
    if len(args.depths) > 1:
        print_table(totals, [("policy", "policy", ""), ("length", "length", "d"), ("found", "found", "d"),
                             ("trials", "trials", "d"), ("accuracy", "accuracy", ".2f")],
                    title=f"\nall depths ({' '.join(str(d) for d in args.depths)})")
    write_json(args.json, {"benchmark": "passkey", "model": args.model, "rows": rows, "totals": totals,
                           "trials": trials})
    return 0
