"""Benchmarks: `python -m minikv.bench <name> ...`. Here, those a user runs to choose a policy
(compare, speed, memory, passkey, ppl, gpu-check) and what they share (common.py, shared_prefill.py,
recall_probe.py, probes.py, tasks/, the compare_*.py and gpu_*.py parts); research/, the probes that
look inside one policy's step. Each module that defines `add_arguments(parser)` and `run(args)`
(and a one-line module docstring, "name: what it measures") is a subcommand."""
