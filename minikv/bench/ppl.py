"""ppl: streaming perplexity over a long text, one token per step, every policy in lockstep.

    python -m minikv.bench ppl --tokens 4096 --context 512 --json ppl.json

Teacher forcing over the first --tokens tokens of pydoc_data.topics: token t is fed alone at
position t (the first one is the prefill) and scored on token t + 1, exactly how a streaming cache
sees a long generation. Policies advance in lockstep (token t through every policy, then t + 1),
so a noisy shared machine slows them alike and the ratios hold.

Default rows, all at the effective context cap C = --context (the paper's Sec. 4.1):
  Full KV                     `full`: every token kept (positions must fit the model's context)
  StreamingLLM                `streaming:sink=4,window=C-4,R=1,slack=0,max_drop=0`
  Lazy+Slack+Max_Drop         `streaming:sink=4,window=C-4,R=32,slack=16,max_drop=32`
  w/o Slack, w/o Max_Drop     the same with slack=0, and with max_drop=0 (Table 3)
  Window recompute            the paper's fair baseline: no cache, each prediction a fresh forward
                              over the last C tokens. It costs C tokens per step, so it is run on
                              every --baseline-every-th position only; `PPL sub` gives every row's
                              perplexity on those same positions.
--policy SPEC (repeatable) replaces the default rows. TPOT@N is the mean step time over the
--tpot-span steps before N tokens; `TPOT x full` is this row's TPOT over the first row's (below 1
is faster; the first row is full KV unless --policy says otherwise). KV MB: the
cache's allocated K and V, all layers (for window recompute: the K, V its forward holds).
Progress, with an estimate of the time left, goes to stderr; the table to stdout.
"""
from __future__ import annotations

import math
import sys
import time

import torch

from ..policies import make
from ..progress import progress_bar
from .common import add_common_arguments, load_model, print_table, text_ids, write_json


def default_policies(C: int) -> list[tuple[str, str]]:
    W = C - 4
    return [
        ("Full KV", "full"),
        ("StreamingLLM", f"streaming:sink=4,window={W},R=1,slack=0,max_drop=0"),
        ("Lazy+Slack+Max_Drop", f"streaming:sink=4,window={W},R=32,slack=16,max_drop=32"),
        ("w/o Slack", f"streaming:sink=4,window={W},R=32,slack=0,max_drop=32"),
        ("w/o Max_Drop", f"streaming:sink=4,window={W},R=32,slack=16,max_drop=0"),
    ]


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=int, default=2048, help="tokens of text to stream (default 2048)")
    p.add_argument("--context", type=int, default=512, help="effective context cap C of the default rows (512)")
    p.add_argument("--policy", action="append", help="policy spec, repeatable (replaces the default rows)")
    p.add_argument("--baseline-every", type=int, default=64,
                   help="window-recompute baseline on every K-th position (0: skip it; default 64)")
    p.add_argument("--short", type=int, default=512, help="also report PPL over the first N tokens (512)")
    p.add_argument("--tpot-at", type=int, nargs="*", default=[600, 4096], help="token counts for TPOT@N")
    p.add_argument("--tpot-span", type=int, default=100, help="steps averaged for TPOT@N (100)")
    add_common_arguments(p)


def nll_of(logits: torch.Tensor, target: int) -> float:
    # logits (V,) -> -log p(target)
    return float(torch.logsumexp(logits, 0) - logits[target])


def ppl(nlls, positions=None) -> float | None:
    vals = [nlls[t] for t in positions] if positions is not None else nlls
    return math.exp(sum(vals) / len(vals)) if vals else None


def check(args) -> None:
    """The flags that need no model (python -m minikv.bench calls this before loading it)."""
    if args.tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (one fed, one scored), got {args.tokens}")
    if args.context < 5:
        raise ValueError(f"--context must be >= 5 (4 sink tokens and a window), got {args.context}")
    for name in ("baseline_every", "short", "tpot_span"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    bad = [at for at in args.tpot_at if at < 1]
    if bad:
        raise ValueError(f"--tpot-at takes token counts >= 1, got {bad[0]}")
    for spec in args.policy or [spec for _, spec in default_policies(args.context)]:
        make(spec)


def score_stream(model, ids, policies, nlls, times, sub, base_nll, base_times, C: int, bar, scored: list) -> None:
    """Feed ids one token at a time to every policy: nlls[i][t], times[i][t] per token, and the
    window-recompute baseline at the positions of `sub`; scored[0] counts the tokens every policy
    scored (what an interrupt keeps)."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    zero = torch.zeros(1, dtype=torch.long, device=model.device)
    for t in range(ids.shape[1] - 1):
        pos = torch.tensor([[t]], device=model.device)
        for i, policy in enumerate(policies):
            t0 = time.perf_counter()
            logits = model(ids[:, t:t + 1], positions=pos, policy=policy, logits_at=zero)[0]
            sync()
            times[i][t] = time.perf_counter() - t0
            nlls[i][t] = nll_of(logits, int(ids[0, t + 1]))
        if t in sub:  # the fair baseline: a fresh forward over the last C tokens, no cache
            lo = max(0, t + 1 - C)
            t0 = time.perf_counter()
            logits = model(ids[:, lo:t + 1], logits_at=torch.tensor([t - lo], device=model.device))[0]
            sync()
            base_times.append(time.perf_counter() - t0)
            base_nll[t] = nll_of(logits, int(ids[0, t + 1]))
        scored[0] = t + 1
        bar.update(1)


def run(args) -> int:
    check(args)
    model, tok = load_model(args)
    N, C = args.tokens, args.context
    ids = torch.tensor([text_ids(tok, N)], device=model.device)  # (1, N)
    named = [(spec, spec) for spec in args.policy] if args.policy else default_policies(C)
    policies = [make(spec).bind(model.cfg, device=model.device, dtype=model.dtype, max_len=N) for _, spec in named]
    nlls = [[0.0] * (N - 1) for _ in named]  # nlls[i][t]: -log p(token t + 1 | stream up to t)
    times = [[0.0] * (N - 1) for _ in named]  # times[i][t]: seconds of the forward that fed token t
    sub = list(range(args.baseline_every - 1, N - 1, args.baseline_every)) if args.baseline_every else []
    base_nll, base_times, scored = {}, [], [0]
    bar = progress_bar(total=N - 1, desc="ppl", unit="tok", mininterval=1.0 if sys.stderr.isatty() else 30.0)
    try:
        score_stream(model, ids, policies, nlls, times, sub, base_nll, base_times, C, bar, scored)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the tokens every policy scored
        done = scored[0]
        if done < 2:
            raise KeyboardInterrupt("fewer than two tokens were scored, nothing was kept") from None
        nlls, times = [n[:done] for n in nlls], [ts[:done] for ts in times]
        sub = [t for t in sub if t < done]
        base_nll, base_times = {t: base_nll[t] for t in sub}, base_times[:len(sub)]
    bar.close()
    interrupted = len(nlls[0]) < N - 1
    if interrupted:
        N = len(nlls[0]) + 1
        print(f"stopped: the table holds the first {N - 1} tokens scored", file=sys.stderr)

    def tpot(ts, at=None):
        steps = ts[1:] if at is None else ts[max(1, at - args.tpot_span):min(at, len(ts))]
        return sum(steps) / len(steps) if steps else None

    rows = []
    for (label, spec), policy, nll, ts in zip(named, policies, nlls, times):
        st = policy.stats()
        row = {"method": label, "spec": spec, "ppl": ppl(nll), "ppl_short": ppl(nll[: args.short]),
               "ppl_sub": ppl(nll, sub) if sub else None, "tpot_s": tpot(ts),
               "kv_mb": st["device_bytes_allocated"] / 2**20, "peak_tokens": st["device_tokens_peak"],
               "prune_events": st.get("prune_events"), "drop_mean": st.get("dropped_per_event_mean"),
               "mem_percent": st.get("mem_percent"),  # policies that report it (synckv): device KV / full KV
               "step_times_s": ts}
        for at in args.tpot_at:
            row[f"tpot_at_{at}_s"] = tpot(ts, at)
        rows.append(row)
    if sub:
        kv_bytes = 2 * model.cfg.n_layers * model.cfg.n_kv_heads * model.cfg.head_dim * C * ids.new_empty(
            (), dtype=model.dtype).element_size()
        rows.append({"method": f"Window recompute (every {args.baseline_every})", "spec": f"window:{C}",
                     "ppl_sub": ppl(base_nll, sorted(base_nll)), "tpot_s": sum(base_times) / len(base_times),
                     "kv_mb": kv_bytes / 2**20, "peak_tokens": C})
    for r in rows:
        r["tpot_x_full"] = r["tpot_s"] / rows[0]["tpot_s"] if r["tpot_s"] and rows[0]["tpot_s"] else None
        for key in [k for k in r if k.endswith("_s") and r[k] is not None and k != "step_times_s"]:
            r[key.replace("_s", "_ms")] = 1000 * r[key]

    columns = [("method", "method", ""), ("TPOT ms", "tpot_ms", ".1f"), ("TPOT x full", "tpot_x_full", ".2f"),
               ("PPL", "ppl", ".3f"), (f"PPL first {args.short}", "ppl_short", ".3f"), ("PPL sub", "ppl_sub", ".3f"),
               ("KV MB", "kv_mb", ".1f"), ("peak tok", "peak_tokens", ".0f"), ("prunes", "prune_events", "d"),
               ("drop/prune", "drop_mean", ".1f"), ("Mem%", "mem_percent", ".1f")]
    columns += [(f"TPOT@{at} ms", f"tpot_at_{at}_ms", ".1f") for at in args.tpot_at]
    print_table(rows, columns, title=f"{args.model}, {N} tokens of pydoc_data.topics, one token per step, C = {C}")
    write_json(args.json, {"benchmark": "ppl", "model": args.model, "tokens": N, "context": C,
                           "baseline_every": args.baseline_every, "baseline_positions": sub, "rows": rows,
                           "complete": not interrupted})
    if interrupted:
        raise KeyboardInterrupt(f"the {N - 1} tokens scored are in the table above"
                                + (f" and in {args.json}" if args.json else ""))
    return 0
