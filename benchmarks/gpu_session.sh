#!/usr/bin/env bash
# Kiln's GPU suite, one part at a time (each but `tests` takes under 10 minutes on a recent GPU; name its files to split it).
# Run it from the repository root on a CUDA machine (see benchmarks/README.md):
#
#   bash benchmarks/gpu_session.sh tests [PATH...]       # GPU-only tests + kernel tests on CUDA, a pytest per file
#   bash benchmarks/gpu_session.sh kernels               # kernel microbenchmarks at real shapes
#   bash benchmarks/gpu_session.sh suite CASE[,CASE] [VARIANT,...]  # the GPU suite, some cases (all variants)
#   bash benchmarks/gpu_session.sh shapes auto|dynamic|kiln [sdxl|flux]  # kiln bench --shapes at full size, one variant
#   bash benchmarks/gpu_session.sh cache                 # kiln bench --cache at SDXL size: restart cost, cold vs warm
#   bash benchmarks/gpu_session.sh prompts [sdxl|flux]   # kiln bench --prompts: the first prompts, regions lowered in the background or not
#   bash benchmarks/gpu_session.sh host CASE [VARIANT,...]   # where a step's host time goes: launches, syncs, cProfile
#   bash benchmarks/gpu_session.sh comfyui sd15|sdxl|flux [default|fp8] [GB]   # Kiln in ComfyUI (the bundle in .comfy-bundle/,
#                                                        #   docs/comfyui-gpu.md): the example workflows' rows, one model; GB caps CUDA memory
#
# Results and the raw log go to $OUT, by default benchmarks/results/gpu-<date>/.
set -euo pipefail
usage="usage: gpu_session.sh tests [PATH...] | kernels | suite CASE[,CASE] [VARIANT,...] | shapes auto|dynamic|kiln [sdxl|flux] | cache | prompts [sdxl|flux] | host CASE [VARIANT,...] | comfyui sd15|sdxl|flux [default|fp8] [GB]"
part="${1:-}"
case "$part ${2:-}" in
    tests\ *|"kernels "|suite\ ?*|"shapes auto"|"shapes dynamic"|"shapes kiln"|"cache "|"prompts "|"prompts sdxl"|"prompts flux"|host\ ?*|"comfyui sd15"|"comfyui sdxl"|"comfyui flux") ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
if [ "$part" = shapes ]; then  # the model: SDXL unless named
    case "${3:-}" in ""|sdxl|flux) ;; *) echo "$usage" >&2; exit 2 ;; esac
fi
if [ "$part" = prompts ] && [ $# -gt 2 ]; then echo "$usage" >&2; exit 2; fi
if [ "$part" = host ]; then  # a case name (it names the output file): letters, digits and dashes
    [[ "$2" =~ ^[a-z0-9-]+$ ]] || { echo "$usage" >&2; exit 2; }
fi
if [ "$part" = comfyui ]; then  # weights as loaded (fp8: ComfyUI casts them as it loads), a memory cap in GiB
    case "${3:-}" in ""|default|fp8) ;; *) echo "$usage" >&2; exit 2 ;; esac
    [[ "${4:-}" =~ ^([0-9]+(\.[0-9]+)?)?$ ]] && [ $# -le 4 ] || { echo "$usage" >&2; exit 2; }
fi
if [ "$part" = tests ]; then  # only test files and folders of this checkout
    for path in "${@:2}"; do
        case "$path" in *..*) echo "$usage" >&2; exit 2 ;; tests/*) [ -e "$path" ] || { echo "$usage" >&2; exit 2; } ;;
            *) echo "$usage" >&2; exit 2 ;; esac
    done
fi
out="${OUT:-benchmarks/results/gpu-$(date +%F)}"
mkdir -p "$out"

pythonpath=()
if [ -d .whl ]; then  # wheels downloaded elsewhere for a machine without network access
    site="${TMPDIR:-/tmp}/kiln-site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    pythonpath+=("$site")
fi
if [ "$(python3 -c 'import kiln, os; print(os.path.dirname(os.path.realpath(kiln.__file__)))' 2>/dev/null)" != "$(pwd -P)" ]; then
    # kiln is not installed from this checkout: the repository root is the `kiln` package
    pkgs="${TMPDIR:-/tmp}/kiln-pkgs"
    mkdir -p "$pkgs" && ln -sfn "$PWD" "$pkgs/kiln"
    pythonpath=("$pkgs" ${pythonpath[@]+"${pythonpath[@]}"})
fi
if [ ${#pythonpath[@]} -gt 0 ]; then
    PYTHONPATH="$(IFS=:; echo "${pythonpath[*]}")${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee "$out/machine.txt"

case "$part" in
    tests)  # Triton compiling for real on CUDA tensors (CI runs the kernels interpreted on CPU tensors).
        # One pytest per file, each failure's traceback printed as it ends: a run cut short keeps them.
        shift
        paths=("$@"); if [ ${#paths[@]} -eq 0 ]; then paths=(tests/gpu/test_*.py tests/kernels/test_*.py); fi
        status=0
        for path in "${paths[@]}"; do
            TRITON_INTERPRET=0 python3 -m pytest -p no:cacheprovider -q --tb=short -rfE "$path" 2>&1 \
                | tee -a "$out/gpu-tests.log" || status=1
        done
        exit $status ;;
    kernels)
        for k in geglu group_norm_silu layer_norm_modulate; do
            python3 -m kiln.benchmarks.bench_$k --device cuda --json "$out/bench_$k.json"
        done 2>&1 | tee "$out/kernel-benches.log" ;;
    suite)  # a folder per set of cases: the suite names its files <date>-<gpu>.json/.log
        cases="$2"
        suite_out="$out/suite-${cases//,/-}"
        mkdir -p "$suite_out"
        variants=(); if [ -n "${3:-}" ]; then variants=(--variants "$3"); fi
        python3 -m kiln.benchmarks.gpu_suite --cases "$cases" ${variants[@]+"${variants[@]}"} --out "$suite_out" 2>&1 \
            | tee "$suite_out/suite-${cases//,/-}.log" ;;
    shapes)
        variant="$2"
        if [ "$variant" = kiln ]; then args=(--modes balanced --baselines none); else args=(--modes "" --baselines "$variant"); fi
        model="${3:-sdxl}"
        python3 -m kiln.cli bench --shapes --device cuda --model "$model" "${args[@]}" \
            --json "$out/shapes-$model-$variant.json" 2>&1 | tee "$out/shapes-$model-$variant.log" ;;
    host)  # wall, host and GPU busy time per step, launches and synchronisations, the host functions that cost most
        variants=(); if [ -n "${3:-}" ]; then variants=(--variants "$3"); fi
        python3 -m kiln.benchmarks.host_profile --case "$2" ${variants[@]+"${variants[@]}"} --out "$out" 2>&1 \
            | grep -v pow_by_natural | tee "$out/host-$2.out" ;;
    prompts)  # seconds per prompt in fresh processes: eager, Kiln, Kiln with background: true (20 steps, 5 s idle)
        model="${2:-sdxl}"
        python3 -m kiln.cli bench --prompts --device cuda --model "$model" --prompt-steps 20 \
            --json "$out/prompts-$model.json" 2>&1 | tee "$out/prompts-$model.log" ;;
    comfyui)  # ComfyUI from the bundle (comfy_bundle.py): its tree unpacked, its wheels installed beside the machine's
        bundle="${COMFY_BUNDLE:-.comfy-bundle}"
        [ -f "$bundle/comfyui.tar.xz" ] || { echo "no ComfyUI bundle in $bundle (docs/comfyui-gpu.md)" >&2; exit 2; }
        comfy_root="${TMPDIR:-/tmp}/kiln-comfyui"
        rm -rf "$comfy_root" && mkdir -p "$comfy_root"
        python3 -m tarfile -e "$bundle/comfyui.tar.xz" "$comfy_root"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$comfy_root/site" "$bundle"/wheels/*.whl
        export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$comfy_root/site"
        model="$2" weights="${3:-default}" tag="$2"
        args=(--model "$model" --device cuda --steps 8)
        if [ "$model" != flux ] || [ "$weights" = fp8 ]; then args+=(--via-file --weight-dtype "$weights"); fi
        if [ "$weights" = fp8 ]; then tag+="-fp8"; fi
        if [ -n "${4:-}" ]; then args+=(--memory-gb "$4"); tag+="-${4}gb"; fi
        mkdir -p "$out/comfyui"
        timeout 480 python3 -m kiln.benchmarks.comfy_workflows --comfyui "$comfy_root/ComfyUI" "${args[@]}" --tag "$tag" \
            --out "$out/comfyui" 2>&1 | tee "$out/comfyui/run-$tag.out" ;;
    cache)  # time to first step in fresh processes: Kiln cold, Kiln warm from its cache, torch.compile cold and warm
        python3 -m kiln.cli bench --cache --device cuda --model sdxl --json "$out/cache-sdxl.json" 2>&1 \
            | tee "$out/cache-sdxl.log" ;;
esac
