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

import time
from dataclasses import dataclass, field

import torch

from ..generate import decode_n_tokens, decode_one_token, prefill
from ..policies import make
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
        layers = self.policy.layers
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
    new, _ = decode_n_tokens(model, logits, lengths, b.policy, max_new_tokens, eos, (0.0, None, None), None,
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
