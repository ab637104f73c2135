"""What check_policy (policies.py) watches inside a run: every K and V row a policy's layers were
given, each decode step's output against dense attention over attended_indices() (listed once
each), every row its tiers bring back to the device, and, with an oracle (oracle.py), what the
oracle says each step attends; a broken contract is a PolicyContractError."""
from __future__ import annotations

import math

import torch


class PolicyContractError(AssertionError):
    """A policy broke the contract: the message names the check, the model and the spec."""


def fail(where: str, what: str):
    raise PolicyContractError(f"{where}: {what}")


class Recorder:
    """Wraps a bound policy's layers and tiers: keeps every K and V row a layer was given, checks
    each decode step's output against dense attention over attended_indices(), and each row the
    tiers bring back to the device against the rows given."""

    def __init__(self, policy, cfg, where, spec, attended, oracle=None):
        self.cfg, self.where, self.spec, self.attended = cfg, where, spec, attended
        self.oracle = oracle  # an oracle.OracleRun, told of every forward of every layer, or None
        self.rows: set[bytes] = set()
        self.kv = {}  # layer -> (positions (n,), k, v (Hkv, n, D))
        for i, layer in enumerate(policy.layers):
            layer.prefill = self._wrap(i, layer, layer.prefill, decoding=False)
            layer.decode = self._wrap(i, layer, layer.decode, decoding=True)
        t = policy.tiers
        to_device, gather, copy_in = t.to_device, t.gather_to_device, t.copy_in
        t.to_device = lambda x, fresh=False: self._back(to_device(x, fresh))
        t.gather_to_device = lambda src, rows, out: (gather(src, rows, out), self._back(out))[0]
        t.copy_in = lambda staging, g, scatter, into, background=False: copy_in(
            staging, g, lambda rows: scatter(self._back(rows)), into, background)

    def _wrap(self, i, layer, fn, decoding):
        def call(q, k, v, positions):
            self._keep(i, k, v, positions)
            out = fn(q, k, v, positions)
            if decoding and self.attended:
                self._attended(i, layer, q, out, int(positions[0, -1]))
            if self.oracle is not None:
                self.oracle.after(i, layer, q, self.kv[i], decoding)
            return out
        return call

    def _keep(self, i, k, v, positions):
        D = k.shape[-1]  # the rows' bytes, read on the host wherever the test device is
        self.rows.update(r.numpy().tobytes() for t in (k, v) for r in t.detach().reshape(-1, D).cpu())
        pos, ks, vs = self.kv.get(i, (positions[0][:0], k[0][:, :0], v[0][:, :0]))
        self.kv[i] = (torch.cat([pos, positions[0]]), torch.cat([ks, k[0]], dim=1), torch.cat([vs, v[0]], dim=1))

    def _back(self, x):
        D = self.cfg.head_dim
        if x.is_floating_point() and x.shape[-1] % D == 0:  # rows of K or V, or of both side by side
            for r in x.detach().reshape(-1, D).cpu():
                if r.any() and r.numpy().tobytes() not in self.rows:
                    fail(self.where, f"offload: {self.spec} brought back to the device a K or V row it was never "
                                      f"given (the round trip through the host must be bit for bit)")
        return x

    def _attended(self, i, layer, q, out, p):
        pos, k, v = self.kv[i]  # (n,), (Hkv, n, D)
        read = layer.attended_indices()
        Hkv, G = k.shape[0], q.shape[1] // k.shape[0]
        window = self.cfg.sliding_window
        for m in range(Hkv if read is not None else 0):
            listed = read[m][read[m] >= 0]
            if listed.unique().numel() != listed.numel():
                twice = sorted({t for t in listed.tolist() if listed.tolist().count(t) > 1})
                fail(self.where, f"attended: layer {i}, KV head {m} at position {p}: attended_indices() lists "
                                  f"token{'s' * (len(twice) > 1)} {', '.join(map(str, twice))} more than once "
                                  f"(a duplicate: each token attended is listed once)")
        for h in range(q.shape[1]):
            if read is None:
                sel = (pos <= p) & ((p - pos < window) if window else True)
            else:
                sel = torch.isin(pos, read[h // G][read[h // G] >= 0])
            kh, vh = k[h // G][sel].float(), v[h // G][sel].float()
            w = torch.softmax(kh @ q[0, h, 0].float() / math.sqrt(q.shape[-1]), dim=0)
            if not torch.allclose(out[0, h, 0].float(), w @ vh, rtol=1e-4, atol=1e-5):
                fail(self.where, f"attended: layer {i}, query head {h} at position {p}: {self.spec}'s output is "
                                  f"not dense attention over attended_indices() ({int(sel.sum())} tokens)")
