"""speed: time to first token, time per output token (TPOT), achieved bandwidth, per policy and
prompt length.

    python -m minikv.bench speed --prompt-lengths 500 2000 --policy full --policy streaming:window=252
    python -m minikv.bench speed --prompt-lengths 1000 2000 4000 8000 --policy full \\
        --policy streaming --png docs/speed_context.png

Prompts are the first N tokens of the standard library's pydoc_data.topics text; generation
ignores EOS so every run decodes --new-tokens tokens. Policies take turns run by run (--warmup
untimed rounds, then --repeats timed ones) and medians are reported, so a noisy machine slows
them alike.

Ratios follow one convention: this / baseline, the baseline being the `full` policy when it is
in the run, else the first policy: `TPOT x full` 0.5 is twice as fast, lower is better.

Bandwidth: a decode step reads every weight once (the tied embedding again as the output head)
plus the KV its attention reads; bytes per step / TPOT is the achieved bandwidth. At the start of
the run the benchmark measures the machine's read bandwidth with the same thread count (a large
tensor summed, median of 5), and reports the achieved bandwidth as a share of it.

--lockstep: one prefill forward for all policies whose prefill outputs agree with the first
policy's (a policy whose prefill differs, such as streaming pruning inside a long prompt, gets a
prefill forward of its own), then the policies decode in lockstep, step t of every policy before step
t + 1 of any, each greedy on its own tokens. On a machine whose load changes during a run this
keeps the TPOT ratios fair (every policy's step t runs within seconds of the others'), and it
costs one long prefill instead of one per policy and repeat. TTFT is not per policy then ('-').

Threads, counted fairly: a policy whose selection runs on a worker thread (freekv's overlap=true,
policies/worker.py) decodes on torch's intra-op threads plus that one; the `threads` column is
the sum. --full-threads runs full KV once per thread count given (as `full@N` where N is not
--threads), so that it runs on as many threads as a policy with a worker, in the same run:

    python -m minikv.bench speed --threads 1 --lockstep --prompt-lengths 2000 --new-tokens 8 \\
        --full-threads 1 2 --policy freekv:overlap=false --policy freekv

Each ratio is then to the `full` run with the same thread count (one core: full against
freekv:overlap=false; two: full@2 against freekv, 1 intra-op thread + its worker), else to the
baseline below.

Where decoding goes: for policies that choose and bring back KV (freekv, icecache), timers
installed from outside (bench/probes.py) around each layer's `select` and its storage's `recall`
give select_s and recall_s, and their shares of the decode time: the time on the model's thread
(a worker's selections run beside it and are not counted; the model's wait for one at its join is
in the decode time only). The policy share is the policy's whole part of the step, its layers'
`decode` (attention over what it reads, and the selection and recall inside) and its `end_step`;
the rest of the step is the model's own (weights, norms, the output head).
"""
from __future__ import annotations

import statistics
import sys
import time
from contextlib import ExitStack

import torch

from ..generate import decode_bandwidth, decode_one_token, generate, synchronize, weight_bytes_per_step
from ..policies import make
from ..policies.worker import thread_counts
from .common import add_common_arguments, load_model, measure_read_bandwidth, print_table, text_ids, write_json
from .probes import timed
from .shared_prefill import shared_prefill
from .speed_ratios import baseline_policy, plot_context, same_threads_baseline, split_threads


def add_arguments(p) -> None:
    add_common_arguments(p)
    p.add_argument("--policy", action="append",
                   help="policy spec, repeatable (default: full)")
    p.add_argument("--full-threads", type=int, nargs="+", default=None, metavar="N",
                   help="also run full KV on N intra-op threads, for each N (a policy with a worker thread is "
                        "compared with full KV on as many threads)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[500], help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per run (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs before measuring (--lockstep: untimed first decode steps)")
    p.add_argument("--lockstep", action="store_true",
                   help="one shared prefill, then every policy decodes step by step in turn (no TTFT per policy)")
    p.add_argument("--prefill-threads", type=int, default=None, metavar="N",
                   help="--lockstep: run the shared prefill on N intra-op threads (it is timed for no policy; "
                        "default: --threads)")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="plot TPOT / full KV's TPOT (the baseline's, same run) against prompt length, one line "
                        "per policy (needs matplotlib)")


def summarize(runs: list[dict], new_tokens: int) -> dict:
    """Medians over the timed runs of one policy at one prompt length."""
    return {
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "tpot_s": statistics.median(r["tpot_s"] for r in runs),
        "threads": runs[-1]["threads"],
        "device_tokens_peak": runs[-1]["device_tokens_peak"],
        "device_bytes": runs[-1]["device_bytes_allocated"],
        "bytes_per_token": runs[-1]["bytes_per_token"],
        # the share of decoding a policy's selection and recall took (with_probes, or its own timers;
        # a policy may have one without the other), and each part on its own (the JSON rows):
        # selection (a page-score pass, or a tree search) and recall
        "overhead_share": share(runs, ("select_s", "recall_s"), new_tokens),
        "select_share": share(runs, ("select_s",), new_tokens),
        "recall_share": share(runs, ("recall_s",), new_tokens),
        # the policy's whole part of the step (its layers' decode, attention included, and its
        # end_step): the rest is the model's (weights, norms, the head)
        "policy_share": share(runs, ("policy_s",), new_tokens),
    }


def check(args) -> None:
    """Flags this benchmark adds, checked before the model loads."""
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (one decode step at least), got {args.new_tokens}")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    if any(n < 1 for n in args.prompt_lengths):
        raise ValueError(f"prompt lengths must be >= 1, got {args.prompt_lengths}")
    if args.full_threads and min(args.full_threads) < 1:
        raise ValueError(f"--full-threads must be >= 1, got {args.full_threads}")
    if args.prefill_threads is not None and (args.prefill_threads < 1 or not args.lockstep):
        raise ValueError(f"--prefill-threads must be >= 1 and goes with --lockstep, got {args.prefill_threads}")


def policy_runs(args) -> list[str]:
    """The runs: each --policy, and full KV once per --full-threads count (`full@N` where N is not
    the --threads count)."""
    policies = list(args.policy or ["full"])
    default = args.threads or torch.get_num_threads()  # before load_model sets --threads
    for n in args.full_threads or ():
        label = "full" if n == default else f"full@{n}"
        if label not in policies:
            policies.append(label)
    return policies


def probe_targets(policy) -> list:
    """What the probes time in a bound policy: each layer (select, and recall where the layer
    has it) and, where the layer has no recall of its own, its storage's (icecache's pages)."""
    storage = [layer.kv for layer in policy.layers if not hasattr(layer, "recall") and hasattr(layer, "kv")]
    return list(policy.layers) + storage


def probes(policy, totals: dict) -> ExitStack:
    """Every timer on a bound policy, into totals: the policy's whole part of a decode step, its
    layers' decode and its end_step ("decode", "end_step"), and within it select and recall
    (probe_targets). The prefill's selection and recall are not counted: the shares are of
    decoding (a share divides by the decode steps' time)."""
    stack, in_step = ExitStack(), [0]
    stack.enter_context(timed(probe_targets(policy), ["select", "recall"], totals, only_within=in_step))
    stack.enter_context(timed(policy.layers, ["decode"], totals, within=in_step))
    stack.enter_context(timed([policy], ["end_step"], totals, within=in_step))
    return stack


def share(runs: list[dict], keys: tuple, new_tokens: int) -> float | None:
    """The median over runs of the decode time spent in `keys` (seconds over a run), or None when
    the policy times none of them."""
    if not any(k in runs[-1] for k in keys):
        return None
    return statistics.median(sum(r.get(k, 0.0) for k in keys) / (r["tpot_s"] * (new_tokens - 1)) for r in runs)


def with_probes(stats: dict, totals: dict) -> dict:
    """stats with select_s and recall_s (seconds over the run) from the probes' totals, where the
    policy does not time them itself, and policy_s: its layers' decode and its end_step."""
    for name in ("select", "recall"):
        if name in totals:
            stats.setdefault(f"{name}_s", totals[name])
    if "decode" in totals:
        stats["policy_s"] = totals["decode"] + totals.get("end_step", 0.0)
    return stats


def timed_generate(model, tokenizer, ids: list[int], spec: str, new_tokens: int) -> dict:
    """generate()'s stats, with the bound policy's select and recall timed from outside
    (bench/probes.py): the probes go on when generate binds the policy and off when it returns.
    A label SPEC@N runs on N intra-op threads (the count before comes back after)."""
    before = torch.get_num_threads()
    spec, intra = split_threads(spec, before)
    policy, totals = make(spec), {}
    torch.set_num_threads(intra)
    with ExitStack() as stack:
        bind = policy.bind

        def bind_and_probe(*args, **kwargs):
            bound = bind(*args, **kwargs)
            stack.enter_context(probes(bound, totals))
            return bound

        policy.bind = bind_and_probe
        try:
            stats = generate(model, tokenizer, ids, policy=policy, max_new_tokens=new_tokens, stop_at_eos=False).stats
        finally:
            torch.set_num_threads(before)
    return with_probes(stats, totals)


def lockstep_prefill(model, ids: list[int], specs: list[str], new_tokens: int) -> tuple[list, list]:
    """Bind every policy and prefill it -> (policies, first token of each): one forward for all
    whose prefill agrees with the first's, one forward each for the others (shared_prefill)."""
    def bind(j):
        return make(split_threads(specs[j], 1)[0]).bind(model.cfg, device=model.device, dtype=model.dtype, max_len=len(ids) + new_tokens)

    def alone(j):
        print(f"  {specs[j]}: its prefill differs from {specs[0]}'s, prefilled on its own", file=sys.stderr)
        return bind(j)

    policies = [bind(j) for j in range(len(specs))]
    logits = shared_prefill(model, ids, policies, rebind=alone)
    return policies, [first.argmax(-1) for first in logits]


def lockstep_runs(model, ids: list[int], specs: list[str], new_tokens: int, warmup: int = 1,
                  prefill_threads: int | None = None) -> dict[str, dict]:
    """Prefill (lockstep_prefill, on `prefill_threads` intra-op threads: it is timed for no
    policy), then greedy decoding of every policy in lockstep -> {spec: stats} with tpot_s the
    mean step time, token_ids the new_tokens tokens, and the policy's own stats. The first
    `warmup` steps are not timed (at least one step is): they compile the kernels of the length's
    buckets (Triton's JIT, kernels/launch.py) and fill caches."""
    warmup = min(warmup, new_tokens - 2)
    before = torch.get_num_threads()
    intra = [split_threads(spec, before)[1] for spec in specs]  # each policy's intra-op threads
    torch.set_num_threads(prefill_threads or before)
    try:
        policies, token = lockstep_prefill(model, ids, specs, new_tokens)
    finally:
        torch.set_num_threads(before)
    times = [[] for _ in specs]
    produced = [[int(t)] for t in token]
    totals = [{} for _ in specs]
    with ExitStack() as stack:
        for policy, tot in zip(policies, totals):
            stack.enter_context(probes(policy, tot))
        for step in range(new_tokens - 1):
            position = torch.tensor([len(ids) + step], device=model.device)
            for j, policy in enumerate(policies):
                torch.set_num_threads(intra[j])
                synchronize(model.device)
                t0 = time.perf_counter()
                out = decode_one_token(model, token[j], position, policy)
                synchronize(model.device)
                if step >= warmup:
                    times[j].append(time.perf_counter() - t0)
                token[j] = out.argmax(-1)
                produced[j].append(int(token[j]))
    torch.set_num_threads(before)
    found = {}
    for spec, policy, ts, toks, tot, n in zip(specs, policies, times, produced, totals, intra):
        stats = with_probes(policy.stats(), tot)
        stats.update(ttft_s=float("nan"), tpot_s=sum(ts) / len(ts), token_ids=toks)
        stats.update(thread_counts(policy, n))
        stats.update(decode_bandwidth(weight_bytes_per_step(model) + stats["kv_bytes_read_per_step"], stats["tpot_s"]))
        found[spec] = stats
    return found


def run(args) -> int:
    policies = policy_runs(args)
    base = baseline_policy(policies)
    model, tokenizer = load_model(args)
    read_bw = measure_read_bandwidth(model.device)
    print(f"read bandwidth: {read_bw / 1e9:.1f} GB/s (large-tensor sum, median of 5)", file=sys.stderr)
    rows, stopped = [], False
    for n in args.prompt_lengths:
        ids = text_ids(tokenizer, n)
        runs = {policy: [] for policy in policies}
        try:
            if args.lockstep:
                print(f"prompt {n}: lockstep", file=sys.stderr)
                found = lockstep_runs(model, ids, policies, args.new_tokens, args.warmup, args.prefill_threads)
                runs = {policy: [found[policy]] for policy in policies}
            else:
                # policies take turns, run by run, so that a noisy shared machine slows them alike
                for i in range(args.warmup + args.repeats):
                    for policy in policies:
                        print(f"prompt {n}, round {i + 1}/{args.warmup + args.repeats}: {policy}", file=sys.stderr)
                        stats = timed_generate(model, tokenizer, ids, policy, args.new_tokens)
                        if i >= args.warmup:
                            runs[policy].append(stats)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the rounds every policy finished
            stopped = True
            if not all(runs.values()):
                break
        cells = []
        for policy in policies:
            row = {"policy": policy, "prompt_tokens": n, **summarize(runs[policy], args.new_tokens)}
            if args.lockstep:
                row["ttft_s"] = None  # one shared prefill: no time to first token per policy
            row["tokens_per_s"] = 1.0 / row["tpot_s"]
            row["tpot_ms"] = 1000 * row["tpot_s"]
            row.update(decode_bandwidth(row["bytes_per_token"], row["tpot_s"], read_bw))
            row["bytes_per_token_mb"] = row["bytes_per_token"] / 1e6
            cells.append(row)
        for row in cells:
            row["tpot_vs_base"] = row["tpot_s"] / same_threads_baseline(cells, row, base)["tpot_s"]
        rows += cells
        if stopped:
            break
    if stopped and not rows:
        raise KeyboardInterrupt("no round was finished by every policy, nothing was kept")
    print_table(rows, [("policy", "policy", ""), ("prompt", "prompt_tokens", "d"), ("threads", "threads", "d"),
                       ("TTFT s", "ttft_s", ".3f"), ("TPOT ms", "tpot_ms", ".2f"),
                       (f"TPOT x full on as many threads, else x {base} (lower is better)", "tpot_vs_base", ".2f"),
                       ("tok/s", "tokens_per_s", ".1f"), ("MB read/token", "bytes_per_token_mb", ".0f"),
                       ("GB/s", "bandwidth_gb_s", ".1f"), ("of read BW", "bandwidth_share", ".0%"),
                       ("peak device tokens", "device_tokens_peak", ".0f"), ("policy share", "policy_share", ".2f"),
                       ("select+recall share", "overhead_share", ".2f")],
                title=f"read bandwidth {read_bw / 1e9:.1f} GB/s, {environment_line(model)}")
    if args.png:
        plot_context(rows, policies, args.png, title=f"{args.model}, {environment_line(model)}, {args.new_tokens} new tokens",
                     base=base)
    write_json(args.json, {"benchmark": "speed", "model": args.model, "new_tokens": args.new_tokens,
                           "baseline": base, "read_bandwidth_gb_s": read_bw / 1e9,
                           "compiled": getattr(model, "compiled", None) is not None, "rows": rows,
                           "complete": not stopped})
    if stopped:
        raise KeyboardInterrupt("the rounds every policy finished are in the table above"
                                + (f" and in {args.json}" if args.json else ""))
    return 0


def environment_line(model) -> str:
    where = "CUDA" if model.device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    compiled = ", compiled decode step" if getattr(model, "compiled", None) is not None else ""
    return f"{str(model.dtype).replace('torch.', '')}, {where}{compiled}"
