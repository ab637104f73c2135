"""icecache (paper 001): semantic KV pages, the leaves of a DCI tree per KV head.

Read in this order: policy.py (the decode step), tree.py (index, insert), search.py (query and
page select, the readable form). search_fast.py and pages_fast.py are the batched forms the
default backends run, tested against search.py.
"""
from .policy import IceCache, IceCacheLayer, SemanticPages

__all__ = ["IceCache", "IceCacheLayer", "SemanticPages"]
