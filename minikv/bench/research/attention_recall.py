"""recall: attention recall of retrieval policies, against full attention and the best selection.

    python -m minikv.bench recall --policy freekv --budget 128 --budget 256 --prompt-length 2048

Attention recall is the share of full attention's probability mass that falls on the tokens a
policy lets attention read: what a retrieval policy (freekv, icecache, ...) must keep high for its
output to stay close to full attention's; recall_probe.py measures it. The command prefills
--prompt-length tokens of pydoc_data.topics, then feeds the next --steps tokens one at a time
(teacher forcing), under full KV (for the oracle) and under each policy at each budget.
"""
from __future__ import annotations

import sys

from ...policies import available, make
from ..common import add_common_arguments, load_model, print_table, text_ids, write_json
from ..compare import BUDGETS, configs
from ..compare_run import long_pass
from ..recall_probe import RecallProbe, renumbers_positions

COMMAND = "recall"


# -- the command ---------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--policy", action="append",
                   help="policy spec, repeatable (default: every registered policy but full)")
    p.add_argument("--budget", type=int, action="append", help="budget for policies that take one, repeatable "
                   "(default 64 128 256 512); the oracle is computed at each")
    p.add_argument("--prompt-length", type=int, default=2048, help="prompt tokens before decoding (2048)")
    p.add_argument("--steps", type=int, default=32, help="tokens fed one at a time after the prompt (32)")
    add_common_arguments(p)


def check(args) -> None:
    """The flags that need no model (python -m minikv.bench calls this before loading it)."""

    budgets = sorted(set(args.budget or BUDGETS))
    if args.prompt_length < 1 or args.steps < 2 or min(budgets) < 1:
        raise ValueError("--prompt-length, --budget must be positive and --steps at least 2")
    return configs(args.policy or [n for n in available() if n != "full"], budgets), budgets


def run(args) -> int:
    try:
        rows, budgets = check(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, tok = load_model(args)
    ids = text_ids(tok, args.prompt_length + args.steps)
    out = []
    for cfg in rows:
        policy = make(cfg["spec"])
        if renumbers_positions(policy):
            print(f"  {cfg['spec']}: renumbers positions, no recall", file=sys.stderr)
            continue
        probe = RecallProbe(policy, budgets if cfg["spec"] == "full" else ())
        try:
            stats = long_pass(model, ids, args.prompt_length, policy)
        except ValueError as e:
            print(f"  {cfg['spec']}: {e}", file=sys.stderr)
            continue
        if cfg["spec"] == "full":
            out += [{"policy": "oracle (best top-b)", "budget": b, "recall": r} for b, r in probe.oracle.items()]
        else:
            out.append({"policy": cfg["spec"], "budget": cfg["budget"], "recall": probe.recall,
                        "measured": probe.count, "device_tokens_peak": stats["device_tokens_peak"]})
        print(f"  {cfg['spec']}: done", file=sys.stderr, flush=True)
    if not out:  # an empty table would read as a result
        raise ValueError("no policy was measured (each one failed or renumbers positions; see above)")
    print_table(out, [("policy", "policy", ""), ("budget", "budget", "d"), ("recall", "recall", ".3f"),
                      ("layer-steps measured", "measured", "d"), ("peak device tokens", "device_tokens_peak", ".0f")],
                title=f"\nattention recall, {args.model}, {args.prompt_length}-token prompt, {args.steps} steps "
                      f"(teacher forcing on pydoc_data.topics); '-': the policy's layers report no attended_indices")
    write_json(args.json, {"benchmark": "recall", "model": args.model, "prompt_length": args.prompt_length,
                           "steps": args.steps, "rows": out})
    return 0

