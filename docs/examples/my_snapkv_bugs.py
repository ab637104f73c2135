"""Four plausible slips in writing SnapKV (my_snapkv.py), each one method replaced. Each is legal
under the policy contract, so check_policy passes it; check_policy(oracle=snapkv_oracle) does not
(docs/extending.md).

    python docs/examples/my_snapkv_bugs.py     # check_policy on each, without and with the oracle
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import minikv
from my_snapkv import MySnapKV


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class WindowOneShort(MySnapKV):
    """The observation window one token short: the last window - 1 queries vote."""

    name = "snapkv_window_short"

    def observation(self, q, k):
        return super().observation(q, k)[:, 1:]


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class GroupsInterleaved(MySnapKV):
    """A KV group mapped wrongly: query head h votes for KV head h % Hkv, not h // G."""

    name = "snapkv_groups_interleaved"

    def group(self, votes):
        return votes.view(-1, self.cfg.n_kv_heads, votes.shape[1]).sum(dim=0)


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class OneQueryHead(MySnapKV):
    """Votes from one query head only: the first of each group."""

    name = "snapkv_one_query_head"

    def group(self, votes):
        return votes.view(self.cfg.n_kv_heads, -1, votes.shape[1])[:, 0]


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class NoCausalMask(MySnapKV):
    """No causal mask inside the window: a window query sees the window's later keys too."""

    name = "snapkv_no_causal_mask"

    def causal(self, w, T, device):
        return torch.zeros(w, T, dtype=torch.bool, device=device)


BUGS = [WindowOneShort, GroupsInterleaved, OneQueryHead, NoCausalMask]


if __name__ == "__main__":
    from minikv.testing import PolicyContractError, check_policy
    from my_snapkv import snapkv_oracle

    quick = dict(families=("llama_gqa",), smollm2=False, backends=("eager",))  # 9 query heads over 3 KV heads
    print("mysnapkv:", ", ".join(check_policy(MySnapKV, oracle=snapkv_oracle, **quick)))
    for bug in BUGS:
        check_policy(bug, **quick)  # the contract holds: no error
        try:
            check_policy(bug, oracle=snapkv_oracle, **quick)
            print(f"{bug.name}: missed")
        except PolicyContractError as failure:
            print(failure)
