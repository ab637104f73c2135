"""softfreeze (ASR-KF-EGR): the policy (policy.py), Algorithm 1 per layer as the paper writes it
(schedule.py, `backend=reference`), its fast all-layers form (schedule_fast.py, layer_fast.py,
the default) and the entropy-guided recovery ladder (recovery.py). Importing registers it."""
from .policy import SoftFreeze
from .schedule import Algorithm1Layer, freeze_duration
from .schedule_fast import NOT_FROZEN, FreezeTiers

__all__ = ["SoftFreeze", "Algorithm1Layer", "FreezeTiers", "NOT_FROZEN", "freeze_duration"]
