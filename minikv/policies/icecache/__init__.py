"""icecache (paper 001): semantic KV pages, the leaves of a DCI tree per KV head.

Read in this order (README's reading guide): tree.py (the index: Algorithm 2 and the insert),
search.py (Algorithms 3-4, the readable query), then policy.py (the decode step, which picks the
search by backend). search_fast.py and pages_fast.py are the batched forms the default backends
run, tested against search.py. Importing the package registers the policy.
"""
from .policy import IceCache, IceCacheLayer, SemanticPages

__all__ = ["IceCache", "IceCacheLayer", "SemanticPages"]
