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
#   bash benchmarks/gpu_session.sh graphs sd15-512-cfg|sdxl-1024-cfg|flux-1024  # whole-call CUDA graphs, one case
#       under `timeout 480` in all: imports and the tree's size first, the guard's planted faults on CUDA
#       (tests/graphs), then `kiln default` and `torch.compile reduce-overhead` at 10 reps with each row's
#       torch.profiler kernel table. DRY_RUN=1 prints the commands instead of running them.
#   bash benchmarks/gpu_session.sh kernel-table [CASE]   # GPU kernels by class: Kiln whole vs torch.compile (sdxl-1024-cfg)
#   bash benchmarks/gpu_session.sh kernel-records CASE [PASS]  # kernel passes in place, on and off: their decision records
#   bash benchmarks/gpu_session.sh quant CASE rows [VARIANT,...]  # the suite's quant rows, a process per variant, within 480 s
#   bash benchmarks/gpu_session.sh quant CASE profile SCHEME      # torch.profiler kernel table of the quantized step
#   bash benchmarks/gpu_session.sh comfyui tests [PATH...]   # tests/comfyui on the bundle's ComfyUI (not the slow ones)
#   bash benchmarks/gpu_session.sh comfyui sd15|sdxl|flux [default|fp8] [GB [dynamic]]   # Kiln in ComfyUI (the bundle in .comfy-bundle/,
#                                                        #   docs/comfyui-gpu.md): the example workflows' rows, one model; GB caps CUDA memory
#
# Results and the raw log go to $OUT, by default benchmarks/results/gpu-<date>/.
set -euo pipefail
usage="usage: gpu_session.sh tests [PATH...] | kernels | suite CASE[,CASE] [VARIANT,...] | shapes auto|dynamic|kiln [sdxl|flux] | cache | prompts [sdxl|flux] | host CASE [VARIANT,...] | kernel-table [CASE] | kernel-records CASE [PASS] | graphs sd15-512-cfg|sdxl-1024-cfg|flux-1024 | quant CASE rows [VARIANT,...] | quant CASE profile SCHEME | comfyui sd15|sdxl|flux [default|fp8] [GB [dynamic]] | comfyui tests [PATH...]"
part="${1:-}"
case "$part ${2:-}" in
    tests\ *|"kernels "|suite\ ?*|"shapes auto"|"shapes dynamic"|"shapes kiln"|"cache "|"prompts "|"prompts sdxl"|"prompts flux"|host\ ?*|quant\ ?*|"comfyui sd15"|"comfyui sdxl"|"comfyui flux"|"comfyui tests") ;;
    kernel-table\ *|kernel-records\ ?*) ;;
    "graphs sd15-512-cfg"|"graphs sdxl-1024-cfg"|"graphs flux-1024") [ $# -eq 2 ] || { echo "$usage" >&2; exit 2; } ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
if [ "$part" = shapes ]; then  # the model: SDXL unless named
    case "${3:-}" in ""|sdxl|flux) ;; *) echo "$usage" >&2; exit 2 ;; esac
fi
if [ "$part" = prompts ] && [ $# -gt 2 ]; then echo "$usage" >&2; exit 2; fi
if [ "$part" = host ]; then  # a case name (it names the output file): letters, digits and dashes
    [[ "$2" =~ ^[a-z0-9-]+$ ]] || { echo "$usage" >&2; exit 2; }
fi
if [ "$part" = kernel-table ] || [ "$part" = kernel-records ]; then  # one case a run, named as the suite names it
    [[ "${2:-sdxl-1024-cfg}" =~ ^(sd15-512-cfg|sdxl-1024-cfg|flux-1024|vae-decode-1024)$ ]] || { echo "$usage" >&2; exit 2; }
    if [ "$part" = kernel-table ]; then [ $# -le 2 ] || { echo "$usage" >&2; exit 2; }; fi
    if [ "$part" = kernel-records ]; then  # one pass a run where the case's whole compiles take long (SDXL: ~3 min each)
        [ $# -le 3 ] && [[ "${3:-fuse_geglu}" =~ ^(fuse_geglu|fuse_group_norm_silu|fuse_adaln_modulation)$ ]] \
            || { echo "$usage" >&2; exit 2; }
    fi
fi
if [ "$part" = quant ]; then  # a case name (it names the folder), then rows [variants] or profile SCHEME
    [[ "$2" =~ ^[a-z0-9-]+$ ]] || { echo "$usage" >&2; exit 2; }
    case "${3:-} $#" in
        "rows 3") ;;
        "rows 4") [[ "$4" =~ ^[a-z0-9\ +_,.-]+$ ]] || { echo "$usage" >&2; exit 2; } ;;
        "profile 4") [[ "$4" =~ ^[a-z0-9_]+$ ]] || { echo "$usage" >&2; exit 2; } ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
fi
if [ "$part" = comfyui ] && [ "$2" = tests ]; then  # only the ComfyUI test files and folders of this checkout
    for path in "${@:3}"; do
        case "$path" in *..*) echo "$usage" >&2; exit 2 ;; tests/comfyui*) [ -e "$path" ] || { echo "$usage" >&2; exit 2; } ;;
            *) echo "$usage" >&2; exit 2 ;; esac
    done
elif [ "$part" = comfyui ]; then  # weights as loaded (fp8: ComfyUI casts them as it loads), a memory cap in GiB
    case "${3:-}" in ""|default|fp8) ;; *) echo "$usage" >&2; exit 2 ;; esac
    [[ "${4:-}" =~ ^([0-9]+(\.[0-9]+)?)?$ ]] && { [ $# -le 4 ] || { [ $# -eq 5 ] && [ "$5" = dynamic ]; }; } \
        || { echo "$usage" >&2; exit 2; }
fi
if [ "$part" = tests ]; then  # only test files and folders of this checkout
    for path in "${@:2}"; do
        case "$path" in *..*) echo "$usage" >&2; exit 2 ;; tests/*) [ -e "$path" ] || { echo "$usage" >&2; exit 2; } ;;
            *) echo "$usage" >&2; exit 2 ;; esac
    done
fi
out="${OUT:-benchmarks/results/gpu-$(date +%F)}"
if [ "$part" = graphs ]; then  # one case in 480 s, start-up included: every command gets what is left
    GRAPHS_BUDGET_S=480
    graphs_out="$out/graphs-$2"
    graph_steps=(
        "python3 -c 'import torch, triton, diffusers, kiln.compiler.graphs; assert torch.cuda.is_available(), \"no CUDA device\"; print(\"torch\", torch.__version__, \"allocator\", torch.cuda.get_allocator_backend())'"
        "du -sh --exclude=.git . | tee $graphs_out/bundle-size.txt"
        "TRITON_INTERPRET=0 python3 -m pytest -p no:cacheprovider -q --tb=short -rfE -s tests/graphs/test_recorder.py tests/graphs/test_on_cuda.py 2>&1 | tee $graphs_out/guard-tests.log"
        "python3 -m kiln.benchmarks.gpu_suite --cases $2 --variants 'kiln default,torch.compile reduce-overhead' --reps 10 --kernel-tables --no-table --out $graphs_out 2>&1 | tee $graphs_out/suite-$2.log"
    )
    if [ "${DRY_RUN:-}" = 1 ]; then
        echo "budget ${GRAPHS_BUDGET_S} s"; printf '%s\n' "${graph_steps[@]}"; exit 0
    fi
fi
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
    quant)  # one case's quantized rows (benchmarks/quant_rows.py) or its kernel profile (benchmarks/quant_profile.py)
        qout="$out/quant-$2"
        mkdir -p "$qout"
        if [ "$3" = profile ]; then
            timeout 480 python3 -m kiln.benchmarks.quant_profile --case "$2" --scheme "$4" --out "$qout" 2>&1 \
                | tee "$qout/profile-$2-$4.log"
            exit "${PIPESTATUS[0]}"
        fi
        IFS=, read -r -a qvariants <<< "${4:-kiln default,kiln default + quantize defaults,kiln default + fp8_e4m3,kiln default + int8_dynamic}"
        end=$((SECONDS + 480))  # every row of the call within 480 s, each in a process of its own (its own peak memory)
        for variant in "${qvariants[@]}"; do
            left=$((end - SECONDS))
            if [ "$left" -lt 30 ]; then echo "quant: 480 s spent; not run: $variant" | tee -a "$qout/quant-$2.log"; continue; fi
            timeout "$left" python3 -m kiln.benchmarks.quant_rows --case "$2" --variant "$variant" --out "$qout" 2>&1 \
                | tee -a "$qout/quant-$2.log" || true
        done
        python3 -m kiln.benchmarks.quant_rows --case "$2" --compare --out "$qout" | tee "$qout/compare-$2.json" ;;
    prompts)  # seconds per prompt in fresh processes: eager, Kiln, Kiln with background: true (20 steps, 5 s idle)
        model="${2:-sdxl}"
        python3 -m kiln.cli bench --prompts --device cuda --model "$model" --prompt-steps 20 \
            --json "$out/prompts-$model.json" 2>&1 | tee "$out/prompts-$model.log" ;;
    graphs)  # each step under timeout, with what is left of GRAPHS_BUDGET_S (the machine's start-up counts)
        mkdir -p "$graphs_out"
        deadline=$((GRAPHS_BUDGET_S - 10))  # SECONDS counts from the script's start: the installs above count too
        status=0
        for step in "${graph_steps[@]}"; do
            left=$((deadline - SECONDS))
            if [ $left -le 0 ]; then echo "out of time before: $step" | tee -a "$graphs_out/failed.txt"; exit 124; fi
            timeout "$left" bash -o pipefail -c "$step" || { status=$?; echo "failed ($status; 124: timed out): $step" \
                | tee -a "$graphs_out/failed.txt"; }
        done
        exit $status ;;
    kernel-table)  # Kiln whole vs torch.compile: a torch.profiler kernel table per variant, by class (10 steps timed)
        case_name="${2:-sdxl-1024-cfg}"
        timeout 480 python3 -m kiln.benchmarks.kernel_table --case "$case_name" --reps 10 --out "$out" 2>&1 \
            | tee "$out/kernel-table-$case_name.log" ;;
    kernel-records)  # every kernel pass forced on, one at a time, against none: GPU busy per step, the decision records
        passes=(); if [ -n "${3:-}" ]; then passes=(--passes "$3"); fi
        timeout 480 python3 -m kiln.benchmarks.kernel_pass_records --case "$2" ${passes[@]+"${passes[@]}"} --reps 10 \
            --out "$out" 2>&1 | tee "$out/kernel-records-$2${3:+-$3}.log" ;;
    comfyui)  # ComfyUI from the bundle (comfy_bundle.py): its tree unpacked, its wheels installed beside the machine's
        bundle="${COMFY_BUNDLE:-.comfy-bundle}"
        [ -f "$bundle/comfyui.tar.xz" ] || { echo "no ComfyUI bundle in $bundle (docs/comfyui-gpu.md)" >&2; exit 2; }
        comfy_root="${TMPDIR:-/tmp}/kiln-comfyui"
        rm -rf "$comfy_root" && mkdir -p "$comfy_root"
        python3 -m tarfile -e "$bundle/comfyui.tar.xz" "$comfy_root"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$comfy_root/site" "$bundle"/wheels/*.whl
        export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$comfy_root/site"
        mkdir -p "$out/comfyui"
        if [ "$2" = tests ]; then  # the project's ComfyUI tests on the bundle's tree (ComfyUI with --cpu, as in CI)
            paths=("${@:3}"); if [ ${#paths[@]} -eq 0 ]; then paths=(tests/comfyui); fi
            COMFYUI_PATH="$comfy_root/ComfyUI" timeout 540 python3 -m pytest -p no:cacheprovider -q --tb=short -rfEs \
                -m "not slow" "${paths[@]}" 2>&1 | tee "$out/comfyui/tests.log"
            exit "${PIPESTATUS[0]}"
        fi
        model="$2" weights="${3:-default}" tag="$2"
        args=(--model "$model" --device cuda --steps 8)
        if [ "$model" != flux ] || [ "$weights" = fp8 ]; then args+=(--via-file --weight-dtype "$weights"); fi
        if [ "$weights" = fp8 ]; then tag+="-fp8"; fi
        if [ -n "${4:-}" ]; then args+=(--memory-gb "$4"); tag+="-${4}gb"; fi
        if [ "${5:-}" = dynamic ]; then args+=(--dynamic-vram); tag+="-dynamic"; fi  # core's default: dynamic VRAM
        timeout 480 python3 -m kiln.benchmarks.comfy_workflows --comfyui "$comfy_root/ComfyUI" "${args[@]}" --tag "$tag" \
            --out "$out/comfyui" 2>&1 | tee "$out/comfyui/run-$tag.out" ;;
    cache)  # time to first step in fresh processes: Kiln cold, Kiln warm from its cache, torch.compile cold and warm
        python3 -m kiln.cli bench --cache --device cuda --model sdxl --json "$out/cache-sdxl.json" 2>&1 \
            | tee "$out/cache-sdxl.log" ;;
esac
