"""icecache (paper 001): semantic KV pages, the leaves of a DCI tree per KV head.

Read in this order (the reading guide, docs/reading.md): layer.py (the decode step), tree.py (the
index and its insert), search.py (Algorithms 3-4, the readable query). Off the decode step: build.py
(Algorithm 2 at prefill), promotion.py (levels and directions, drawn ahead), policy.py (the
parameters, their checks, and the search each layer runs by backend), counts.py (statistics),
pdci.py (icecache:paper's search), search_fast.py, layout.py and pages_fast.py (the batched forms,
tested against search.py). Importing the package registers the policy.
"""
from .layer import IceCacheLayer, SemanticPages
from .policy import IceCache

__all__ = ["IceCache", "IceCacheLayer", "SemanticPages"]
