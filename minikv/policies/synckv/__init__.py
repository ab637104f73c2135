"""synckv (SyncKV): the policy (policy.py), where its non-representative heads keep their KV
(bank.py: the host context bank and the device slots), and the offline head clustering it reads
(clusters.py; `python -m minikv.bench cluster-heads`)."""
from .policy import SyncKV, SyncKVLayer  # noqa: F401  (registers the policy)
