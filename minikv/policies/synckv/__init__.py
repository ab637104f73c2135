"""synckv (SyncKV): the policy (policy.py: the paper, the map of Algorithm 1, the parameters), its
layer (layer.py: the decode step), where its non-representative heads keep their KV
(bank.py: the host context bank and the device slots), its accounting (accounting.py), the offline
head clustering it reads (clusters.py; `python -m minikv.bench cluster-heads`) and the clustering
each layer runs, settled at bind (binding.py)."""
from .policy import SyncKV, SyncKVLayer  # noqa: F401  (registers the policy)
