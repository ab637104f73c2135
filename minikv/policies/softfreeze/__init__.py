"""softfreeze (ASR-KF-EGR): the policy (policy.py), Algorithm 1 per layer as the paper writes it
(schedule.py, `backend=reference`), its fast all-layers form (schedule_fast.py, layer_fast.py,
the default) and the entropy-guided recovery ladder (recovery.py). Importing registers it and
plugs the fast form into the policy, so that policy.py and schedule.py import none of it."""
from .layer_fast import FastAlgorithm1Layer
from .policy import SoftFreeze
from .schedule import Algorithm1Layer, freeze_duration
from .schedule_fast import NOT_FROZEN, FreezeTiers

SoftFreeze.fast_tiers, SoftFreeze.fast_layer = FreezeTiers, FastAlgorithm1Layer

__all__ = ["SoftFreeze", "Algorithm1Layer", "FastAlgorithm1Layer", "FreezeTiers", "NOT_FROZEN", "freeze_duration"]
