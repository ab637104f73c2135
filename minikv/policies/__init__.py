"""KV-cache policies: one module or package per policy, named after it. `make(spec)` builds one from a spec
string such as "streaming:sink=4,window=252"; `available()` lists the names."""
from .base import LayerKV, Policy, StepAction, available, make, register, register_policy
from .tiers import Tiers
from . import full  # noqa: F401  (registers "full")

__all__ = ["LayerKV", "Policy", "StepAction", "Tiers", "available", "make", "register", "register_policy"]
from . import streaming  # noqa: F401
from . import softfreeze  # noqa: F401
from . import freekv  # noqa: F401
from . import icecache  # noqa: F401
from . import synckv  # noqa: F401
from . import h2o  # noqa: F401
