"""softfreeze (ASR-KF-EGR): the policy (policy.py), Algorithm 1 per layer as the paper writes it
(schedule.py, `backend=reference`), its fast all-layers form (schedule_fast.py, layer_fast.py, the
default; dispatch.py picks the form by backend) and the entropy-guided recovery ladder
(recovery.py). Importing the package registers the policy."""
from .policy import SoftFreeze
from .schedule import Algorithm1Layer, freeze_duration

__all__ = ["SoftFreeze", "Algorithm1Layer", "freeze_duration"]
