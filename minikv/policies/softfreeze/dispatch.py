"""softfreeze's forms by backend, which SoftFreeze (policy.py) asks for at bind: the reference
(schedule.Algorithm1Layer, each layer its own state, run as Algorithm 1 reads: backend=reference)
or the fast form (eager, triton): schedule_fast.FreezeTiers holds the state of all layers stacked
and runs lines 3-15 for every layer at once, and layer_fast.FastAlgorithm1Layer is one layer's
view of it. Both answer the contract and the recovery ladder through the same methods."""
from __future__ import annotations

from .layer_fast import FastAlgorithm1Layer
from .schedule import Algorithm1Layer
from .schedule_fast import FreezeTiers


def stacked_state(policy) -> FreezeTiers | None:
    """The fast form's state of all the policy's layers; None for the reference."""
    return None if policy.backend == "reference" else FreezeTiers(policy, policy.cfg.n_layers)


def make_layer(policy, index: int) -> Algorithm1Layer | FastAlgorithm1Layer:
    """Layer `index` in the policy's form (the fast form's reads policy.state, made after it)."""
    return Algorithm1Layer(policy, index) if policy.backend == "reference" else FastAlgorithm1Layer(policy, index)
