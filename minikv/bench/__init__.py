"""Benchmarks: `python -m minikv.bench <name> ...`. Each module here that defines
`add_arguments(parser)` and `run(args)` (and a one-line module docstring) is a subcommand."""
