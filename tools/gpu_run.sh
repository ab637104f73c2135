#!/usr/bin/env bash
# gpu-check --quick on the GPU machine that is lent (docs/gpu.md, "The lent machine"), from this
# checkout, with that machine's own Python and packages:
#
#   bash tools/gpu_run.sh OUTDIR [WHEELS_DIR]
#
# OUTDIR gets gpu_check.json (every row, rewritten as each one is measured: a run stopped at its
# limit keeps what it measured) and gpu_check.log (all that the run prints). WHEELS_DIR: wheels
# carried along for packages the machine lacks, installed with `pip install --no-index --target`
# into OUTDIR/site-packages (gpu-check --quick needs none today: tests/bench/test_gpu_imports.py
# holds its imports to the machine's packages). PYTHON names the interpreter (default python3).
# The exit code is gpu-check's: 0 passed, 1 a check failed or a part ran out of time, 2 no CUDA.
set -uo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "error: usage: bash tools/gpu_run.sh OUTDIR [WHEELS_DIR]" >&2
    exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$1
python=${PYTHON:-python3}
mkdir -p "$out" || { echo "error: cannot create the output folder $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
path=$repo
if [ $# -eq 2 ]; then
    wheels=("$2"/*.whl)
    if [ ! -e "${wheels[0]}" ]; then
        echo "error: no wheel (*.whl) in $2" >&2
        exit 2
    fi
    echo "installing ${#wheels[@]} carried wheel(s) into $out/site-packages" >&2
    "$python" -m pip install --no-index --no-deps --quiet --target "$out/site-packages" "${wheels[@]}" || exit 2
    path=$repo:$out/site-packages
fi
echo "gpu-check --quick from $repo, results in $out (gpu_check.json, gpu_check.log)" >&2
cd "$repo" || exit 2
PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
    "$python" -m minikv.bench gpu-check --quick --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
