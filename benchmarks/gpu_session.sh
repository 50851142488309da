#!/usr/bin/env bash
# One part of a GPU session on the lent machine, in one `run` call (each under its 10 minutes).
# Run from the repository root there, carrying .whl (see benchmarks/README.md); results and the
# raw log land in $OUT, to be copied into benchmarks/results/ and committed.
#
#   bash benchmarks/gpu_session.sh tests                 # GPU-only tests + kernel tests on CUDA
#   bash benchmarks/gpu_session.sh kernels               # kernel microbenchmarks at real shapes
#   bash benchmarks/gpu_session.sh suite CASE[,CASE] [VARIANT,...]  # the GPU suite, some cases (all variants)
#   bash benchmarks/gpu_session.sh shapes auto|dynamic|kiln   # kiln bench --shapes at SDXL size, one variant
set -euo pipefail
usage="usage: gpu_session.sh tests | kernels | suite CASE[,CASE] [VARIANT,...] | shapes auto|dynamic|kiln"
part="${1:-}"
case "$part ${2:-}" in
    "tests "|"kernels "|suite\ ?*|"shapes auto"|"shapes dynamic"|"shapes kiln") ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
out="${OUT:?OUT (the folder whose files come back) is not set}"

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/pkgs && ln -sfn "$PWD" /tmp/pkgs/kiln  # the repository root is the `kiln` package
export PYTHONPATH=/tmp/pkgs:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee "$out/machine.txt"

case "$part" in
    tests)  # Triton compiling for real on CUDA tensors (CI runs the kernels interpreted on CPU tensors)
        TRITON_INTERPRET=0 python3 -m pytest -p no:cacheprovider tests/gpu tests/kernels -q 2>&1 | tee "$out/gpu-tests.log" ;;
    kernels)
        for k in geglu group_norm_silu layer_norm_modulate; do
            python3 -m kiln.benchmarks.bench_$k --device cuda --json "$out/bench_$k.json"
        done 2>&1 | tee "$out/kernel-benches.log" ;;
    suite)
        cases="$2"
        variants=(); if [ -n "${3:-}" ]; then variants=(--variants "$3"); fi
        python3 -m kiln.benchmarks.gpu_suite --cases "$cases" "${variants[@]}" --out "$out" 2>&1 | tee "$out/suite-${cases//,/-}.log" ;;
    shapes)
        variant="$2"
        if [ "$variant" = kiln ]; then args=(--modes balanced --baselines none); else args=(--modes "" --baselines "$variant"); fi
        python3 -m kiln.cli bench --shapes --device cuda --model sdxl "${args[@]}" \
            --json "$out/shapes-sdxl-$variant.json" 2>&1 | tee "$out/shapes-sdxl-$variant.log" ;;
esac
