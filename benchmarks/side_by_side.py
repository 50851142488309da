"""What every side-by-side benchmark shares: dtypes by name, a device sync, a code object per
variant, and interleaved timing rounds (`kiln bench`, `--quant`, `--shapes`, `--cache`); and, for
those that time several first compiles in one process (`kiln bench`, `--quant`, the GPU suite), a
warm-up compile before the first."""
from __future__ import annotations

import time
from typing import Callable

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def default_size_and_dtype(args) -> None:
    """`kiln bench`'s defaults where --size or --dtype is not given: CPU size in fp32 on a CPU; full
    size in fp16 on CUDA (bf16 for Flux, as it ships)."""
    args.size = args.size or ("full" if args.device == "cuda" else "cpu")
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else ("bf16" if args.model == "flux" else "fp16"))


def child_parser(runs):
    """The arguments a bench gives the fresh process that makes one of its `runs`: `--child RUN` and
    the model's (python -m kiln.benchmarks.<bench> --child ...)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--child", dest="run", choices=runs, required=True)
    for flag in ("--model", "--size", "--device", "--dtype", "--mode", "--cache-dir"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--batch", type=int, required=True)
    return parser


def print_and_save(table: str, result: dict, json_path) -> None:
    """A bench's table on stdout, its result as JSON at `json_path` (if given)."""
    import json

    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _warm_up_function(x):
    return torch.nn.functional.gelu(x) * 2.0 + 1.0


def warm_up_compiler(device: str) -> float:
    """Pay, before any variant is timed, what a process's first compile through Inductor pays once,
    whatever it compiles: torch's compiler imports and first setup; on a CPU, Inductor's probe of
    the vector instruction sets (kept for the process) and its precompiled C++ header (kept in the
    system's temporary folder); on a GPU, Triton's start. Without it the variant timed first pays
    them for all the others: on a 2-core CPU a tiny function's first compile in a fresh process took
    15.8 s with the header already built, the next 2.4 s. Compiled into an empty Inductor cache,
    so no variant finds its kernels. The seconds it took."""
    from ..compiler.torch_compat.inductor import fresh_inductor_cache

    start = time.perf_counter()
    with fresh_inductor_cache(), torch.inference_mode():
        torch.compile(_warm_up_function, dynamic=False)(torch.randn(8, 8, device=device))
        sync(device)
    return time.perf_counter() - start


def own_code(module: torch.nn.Module, tag: str) -> torch.nn.Module:
    """`module` behind a wrapper whose forward is a code object of its own.

    TorchDynamo keeps compiled graphs per code object and checks their guards in turn on every
    call; variants sharing the model's forward would each pay for the guards of the others (seen
    here: an identical Inductor graph 4% slower depending on which variant compiled first).
    """
    namespace: dict = {}
    exec(f"def forward(self, *args, **kwargs):\n    return self.inner(*args, **kwargs)  # {tag}\n", namespace)
    wrapper = type(f"Bench_{tag}", (torch.nn.Module,), {"forward": namespace["forward"]})()
    wrapper.inner = module
    return wrapper


def own_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A variant's own copy of the step's inputs. Every variant is called on its own tensors: Kiln marks
    the sizes of the tensors a compiled model is called with dynamic, on the tensors themselves
    (compiler/shapes/inputs.py), and a torch.compile called on those tensors afterwards would compile
    a dynamic graph (or compile again) where on tensors of its own it compiles a static one."""
    from ..compiler.regional.region_choice import fresh_copies

    return fresh_copies(args, kwargs)


def time_interleaved(calls: dict[str, Callable], inputs: dict[str, tuple[tuple, dict]], device: str, rounds: int,
                     steps: int) -> dict[str, list[float]]:
    """ms per call of each variant on its own inputs (`inputs[name]`: args, kwargs), one sample per
    round; rounds interleave the variants, in an order reversed every other round so no variant
    always runs first (or right after another)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for round_index in range(rounds):
        for name, fn in (order if round_index % 2 == 0 else order[::-1]):
            args, kwargs = inputs[name]
            fn(*args, **kwargs)  # warm
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                fn(*args, **kwargs)
            sync(device)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times
