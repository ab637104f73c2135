"""KV-cache policies, each a module or a package named after it (full.py, streaming.py, freekv.py,
h2o.py; softfreeze/, icecache/, synckv/, where the readable form and its fast forms are separate
files), on the shared parts: contract.py (Policy, LayerKV: what a policy implements), registry.py
(register, make: spec strings), stats.py (the tier accounting), checks.py (what is checked of a
policy), params.py (declared parameters), tiers.py (the counted copies between tiers), paged.py
and pool.py (paged storage). `make(spec)` builds one from a spec string such as
"streaming:sink=4,window=252"; `available()` lists the names."""
from .contract import LayerKV, Policy, StepAction
from .registry import available, make, register, register_policy
from .params import param
from .tiers import Tiers
from . import full  # noqa: F401  (registers "full")

__all__ = ["LayerKV", "Policy", "StepAction", "Tiers", "available", "make", "param", "register", "register_policy"]
from . import streaming  # noqa: F401
from . import softfreeze  # noqa: F401
from . import freekv_policy  # noqa: F401  (registers "freekv"; its rule: freekv.py)
from . import icecache  # noqa: F401
from . import synckv  # noqa: F401
from . import h2o  # noqa: F401
