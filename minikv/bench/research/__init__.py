"""Research probes: benchmarks that look inside one policy's step rather than compare policies for
a user (`python -m minikv.bench --help` lists them apart). needle_mass.py (where a retrieval policy
loses the needle, per layer and head), quant2_cost.py (what freekv's quant2 digest costs),
attention_recall.py (`recall`: attention recall against the best selection), dci_recall.py
(IceCache's tree search against exact inner products), cluster_heads.py (SyncKV's offline head
clustering). Each module with `add_arguments(parser)` and `run(args)` is a subcommand."""
