"""How bench compare runs its rows: prompt by prompt, every policy on the same prefill.

A task instance is prefilled once for all the rows that can share it (shared_prefill.py: every
policy whose prefill attends the whole prompt at its absolute positions; their outputs are checked
equal, layer by layer), and once per row for the others (streaming, whose prefill already evicts,
and any row whose output differed). Then
each row decodes its answer greedily on its own cache. The long pass does the same and then feeds
its tokens one at a time to every row in lockstep: step t of every row before step t + 1 of any,
so a machine whose load drifts slows all rows alike and the TPOT ratios stay fair.
"""
from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from ..generate import decode_n_tokens, decode_one_token, prefill
from ..policies import make
from .intervals import interval
from .tasks import string_match_all
from .recall_probe import RecallProbe, renumbers_positions
from .shared_prefill import shared_prefill
from .ppl import nll_of, ppl


@dataclass
class Bound:
    """One row's policy, bound for one prompt, with its attention-recall probe (None if the
    policy renumbers positions) and the KV it used, sampled after every forward."""
    spec: str
    policy: object
    probe: RecallProbe | None
    device: list[float] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)

    def sample(self, n_prompt: int) -> None:
        # every layer of the model, as stats() counts them: a local layer's window (Gemma 3) holds KV
        # too, so on a hybrid model full KV's own row reads less than full KV in every layer
        layers = self.policy.all_layers()
        self.device.append(sum(layer.device_tokens() for layer in layers) / len(layers))
        self.seq.append(n_prompt + self.policy.steps - 1)


def bind(model, spec: str, max_len: int, oracle_budgets=(), probe: bool = True) -> Bound:
    policy = make(spec)
    recall = RecallProbe(policy, oracle_budgets) if probe and not renumbers_positions(policy) else None
    policy.bind(model.cfg, device=model.device, dtype=model.dtype, max_len=max_len)
    return Bound(spec, policy, recall)


def shares_prefill(b: Bound) -> bool:
    """A policy that rotates the prompt at other than its absolute positions prefills its own way."""
    return not renumbers_positions(b.policy)


def prefill_all(model, rows: list[Bound], ids: list[int], rebind) -> list[torch.Tensor]:
    """Logits after the prompt, per row: one shared forward for the rows that can share it
    (shared_prefill), one forward each for the rest and for those that left the shared one
    (rebind(i) -> a fresh Bound)."""
    shared = [i for i, b in enumerate(rows) if shares_prefill(b)]
    logits: dict[int, torch.Tensor] = {}
    if shared:
        def again(j):
            rows[shared[j]] = rebind(shared[j])
            return rows[shared[j]].policy

        out = shared_prefill(model, ids, [rows[i].policy for i in shared], rebind=again)
        logits.update(zip(shared, out))
    x = torch.tensor([ids], device=model.device)
    lengths = torch.tensor([len(ids)], device=model.device)
    for i, b in enumerate(rows):
        if i not in logits:
            logits[i] = prefill(model, x, lengths, b.policy)
    return [logits[i] for i in range(len(rows))]


def answer(model, tok, b: Bound, logits: torch.Tensor, n_prompt: int, max_new_tokens: int) -> str:
    """Greedy decoding on the row's own cache, up to max_new_tokens or EOS; the KV is sampled as
    each token comes (the first one: after the prefill)."""
    lengths = torch.tensor([n_prompt], device=model.device)
    eos = set(tok.eos_ids)
    new = decode_n_tokens(model, logits, lengths, b.policy, max_new_tokens, eos, (0.0, None, None), None,
                             on_token=lambda row, t: b.sample(n_prompt) if t >= 0 else None)
    return tok.decode([t for t in new[0] if t not in eos])


def lockstep_long_pass(model, ids: list[int], n_prompt: int, rows: list[Bound], rebind) -> list[dict]:
    """Prefill n_prompt tokens for every row, then feed the rest one token at a time to all rows in
    lockstep (teacher forcing): per row the mean step time, the perplexity of the fed tokens (the
    cache decoding sees), the KV it read (sampled after every forward), the tiers at the end."""
    logits = prefill_all(model, rows, ids[:n_prompt], rebind)
    for b in rows:
        b.sample(n_prompt)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    x = torch.tensor(ids, device=model.device)
    nlls = [{n_prompt - 1: nll_of(lg[0], ids[n_prompt])} for lg in logits]
    times: list[list[float]] = [[] for _ in rows]
    t = [n_prompt] * len(rows)
    while any(ti < len(ids) - 1 for ti in t):
        for i, b in enumerate(rows):
            if t[i] >= len(ids) - 1:
                continue
            sync()
            t0 = time.perf_counter()
            out = decode_one_token(model, x[t[i]:t[i] + 1], torch.tensor([t[i]], device=model.device), b.policy)
            sync()
            times[i].append(time.perf_counter() - t0)
            nlls[i][t[i]] = nll_of(out[0], ids[t[i] + 1])
            b.sample(n_prompt)
            action = b.policy.last_action
            t[i] += 1 - (action.rewind if action is not None else 0)  # softfreeze's rewalk feeds tokens again
    return [long_stats(b, ts, nl, len(ids)) for b, ts, nl in zip(rows, times, nlls)]


def long_stats(b: Bound, times: list[float], nlls: dict, n_tokens: int) -> dict:
    st = b.policy.stats()
    return {"tpot_s": sum(times) / len(times), "ppl": ppl(list(nlls.values())), "steps": len(times),
            "kv_share_mean": sum(b.device) / sum(b.seq),  # Mem%: the mean KV read over full KV's
            "device_tokens_peak": st["device_tokens_peak"], "kv_share_peak": st["device_tokens_peak"] / n_tokens,
            "bytes_to_device": st["bytes_to_device"], "bytes_to_host": st["bytes_to_host"],
            "device_bytes": st["device_bytes"], "host_bytes": st["host_bytes"],
            "device_bytes_allocated": st.get("device_bytes_allocated"),
            "host_bytes_allocated": st.get("host_bytes_allocated")}


def long_pass(model, ids: list[int], n_prompt: int, policy) -> dict:
    """One policy's long pass (a spec, or an unbound Policy with a probe attached)."""
    if isinstance(policy, str):
        row = bind(model, policy, len(ids), probe=False)
    else:
        row = Bound(policy.name, policy.bind(model.cfg, device=model.device, dtype=model.dtype, max_len=len(ids)), None)
    return lockstep_long_pass(model, ids, n_prompt, [row], rebind=None)[0]


# -- a compare run: rows x task instances, then the long pass -----------------------------------


class Progress:
    """Work done / to do, weighted by tokens processed, with an ETA, on stderr."""

    def __init__(self, total: float):
        self.total, self.done, self.t0 = total, 0.0, time.perf_counter()

    def step(self, cost: float, message: str) -> None:
        self.done += cost
        elapsed = time.perf_counter() - self.t0
        eta = elapsed * (self.total - self.done) / self.done if self.done else float("nan")
        print(f"[{100 * self.done / self.total:5.1f}%  {fmt_time(elapsed)} elapsed, ETA {fmt_time(eta)}] {message}",
              file=sys.stderr, flush=True)


def fmt_time(s: float) -> str:
    return "?" if not math.isfinite(s) else f"{int(s // 60)}m{int(s % 60):02d}s"


def task_cost(inst, n_rows: int, n_own_prefill: int) -> float:
    # a decode step costs about 20 prompt tokens on a CPU; one shared prefill, one per other row
    return inst.length * (1 + n_own_prefill) + 20 * inst.max_new_tokens * n_rows


def own_prefills(cfgs: list[dict]) -> int:
    """Rows whose policy cannot share the prefill (it renumbers positions: streaming)."""
    return sum(renumbers_positions(make(c["policy"])) for c in cfgs)  # a class's trait: default parameters


class Tally:
    """One row's task results, gathered prompt by prompt."""

    def __init__(self):
        self.scores: dict[str, list[float]] = {}
        self.answers, self.device, self.seq = [], [], []
        self.recall_sum = self.recall_n = 0.0
        self.oracle: dict[int, list[float]] = {}

    def add(self, inst, text: str, b) -> float:
        score = string_match_all([text], [inst.answers])
        self.scores.setdefault(inst.key, []).append(score)
        self.answers.append({"task": inst.key, "seed": inst.seed, "haystack": inst.haystack, "answer": text,
                             "score": score})
        self.device += b.device
        self.seq += b.seq
        if b.probe is not None and b.probe.recall is not None:
            self.recall_sum += b.probe.sum
            self.recall_n += b.probe.count
        for budget, r in (b.probe.oracle.items() if b.probe is not None else ()):
            self.oracle.setdefault(budget, []).append(r)
        return score

    def summary(self) -> dict:
        if not self.device:
            return {}
        shares = [d / s for d, s in zip(self.device, self.seq)]
        return {"scores": {t: sum(v) / len(v) for t, v in self.scores.items()},
                "intervals": {t: list(interval(v)) for t, v in self.scores.items()},
                "instances": {t: len(v) for t, v in self.scores.items()}, "answers": self.answers,
                "kv_mean_tokens": sum(self.device) / len(self.device), "kv_peak_tokens": max(self.device),
                "kv_samples": len(self.device), "seq_tokens": sum(self.seq), "recall_steps": self.recall_n,
                "kv_share_mean": sum(self.device) / sum(self.seq), "kv_share_peak": max(shares),
                "recall": self.recall_sum / self.recall_n if self.recall_n else None,
                "oracle": {b: sum(v) / len(v) for b, v in self.oracle.items()}}


def bind_rows(model, rows: list[dict], max_len: int, oracle_budgets, probe: bool) -> dict[int, Bound]:
    """Bind every row not failed yet; a policy refusing its budget or this length fails its row only."""
    bound = {}
    for i, row in enumerate(rows):
        if row["error"] is None:
            try:
                budgets = oracle_budgets if row["spec"] == "full" else ()
                bound[i] = bind(model, row["spec"], max_len, budgets, probe)
            except (ValueError, RuntimeError) as e:
                fail(row, e)
    return bound


def fail(row: dict, e: Exception) -> None:
    row["error"] = f"{type(e).__name__}: {e}"
    print(f"  {row['spec']}: {row['error']}", file=sys.stderr, flush=True)


def prefill_rows(model, rows, bound: dict[int, Bound], ids, max_len, oracle_budgets, probe) -> dict[int, torch.Tensor]:
    keys = list(bound)
    live = [bound[i] for i in keys]

    def rebind(j):
        return bind(model, rows[keys[j]]["spec"], max_len, oracle_budgets if rows[keys[j]]["spec"] == "full" else (), probe)

    logits = prefill_all(model, live, ids, rebind)
    bound.update(zip(keys, live))  # rebinding replaced some
    return dict(zip(keys, logits))


def run_rows(model, tok, result: dict, instances: list, long_ids: list[int] | None, long_prompt: int,
             saved=lambda: None) -> None:
    """Every row of result["rows"] on every task instance, then the long pass (if long_ids): the
    rows are filled in place, prompt by prompt (saved() after each), with the run's wall time."""
    rows, t0 = result["rows"], time.perf_counter()
    own = own_prefills(rows)
    long_cost = (long_prompt * (1 + own) + 20 * (len(long_ids) - long_prompt) * len(rows)) if long_ids else 0
    progress = Progress(sum(task_cost(i, len(rows), own) for i in instances) + long_cost)
    print(f"compare: {len(rows)} rows x ({len(instances)} task instances{' + long pass' if long_ids else ''}), "
          "one prefill per prompt shared by the rows that can share it", file=sys.stderr, flush=True)
    tallies = [Tally() for _ in rows]
    oracle_budgets = result["settings"]["budgets"]
    for inst in instances:
        max_len = len(inst.ids) + inst.max_new_tokens
        bound = bind_rows(model, rows, max_len, oracle_budgets, probe=True)
        logits = prefill_rows(model, rows, bound, inst.ids, max_len, oracle_budgets, True)
        heard = []
        for i, b in bound.items():
            try:
                text = answer(model, tok, b, logits[i], len(inst.ids), inst.max_new_tokens)
            except (ValueError, RuntimeError) as e:  # one policy failing must not sink the run
                fail(rows[i], e)
                continue
            heard.append(f"{rows[i]['spec']} {tallies[i].add(inst, text, b):.0f}")
        del bound, logits
        gc.collect()  # a policy and its layers point at each other: free this prompt's caches now
        progress.step(task_cost(inst, len(rows), own), f"{inst.key} seed {inst.seed}: " + ", ".join(heard))
        for row, tally in zip(rows, tallies):
            row.update(tally.summary())
        result["wall_s"] = time.perf_counter() - t0
        saved()
    for row in rows:
        oracle = row.pop("oracle", {})
        if row["spec"] == "full":
            result["oracle"] = oracle
    if long_ids:
        run_long_pass(model, rows, long_ids, long_prompt)
        progress.step(long_cost, "long pass: " + ", ".join(
            f"{r['spec']} {1000 * r['long']['tpot_s']:.0f} ms" for r in rows if r.get("long")))
    result["wall_s"] = time.perf_counter() - t0


def run_long_pass(model, rows: list[dict], ids: list[int], n_prompt: int) -> None:
    bound = bind_rows(model, rows, len(ids), (), probe=False)
    keys = list(bound)
    live = [bound[i] for i in keys]

    def rebind(j):
        return bind(model, rows[keys[j]]["spec"], len(ids), (), False)

    for i, stats in zip(keys, lockstep_long_pass(model, ids, n_prompt, live, rebind)):
        rows[i]["long"] = stats
    full = rows[0].get("long") if rows[0]["spec"] == "full" else None
    for row in rows:  # the ratio to this run's full KV, kept with the row when runs are merged
        if row.get("long") and full:
            row["long"]["tpot_x_full"] = row["long"]["tpot_s"] / full["tpot_s"]
