"""Argument checks shared by the GPU scripts that run one suite case (kernel_table.py,
kernel_pass_records.py): each refusal goes through argparse (exit 2) and names the option."""
from __future__ import annotations

import argparse

MAX_REPS = 100   # timed repetitions a script may be asked for


def listed(parser: argparse.ArgumentParser, option: str, text: str, known, what: str) -> tuple[str, ...]:
    """The comma-separated names of `text`, each one of `known`; at least one."""
    names = tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"{option}: {', '.join(unknown) or 'none given'}; {what} are {', '.join(known)}")
    return names


def check_case_reps_and_cuda(parser: argparse.ArgumentParser, case: str, reps: int, measures: str) -> None:
    """Refuse a case that is not one of the GPU suite's full cases, reps outside 1..MAX_REPS, and a
    machine without CUDA (`measures`: what the script measures, for the message)."""
    from .gpu_suite import FULL_CASES

    names = [c.name for c in FULL_CASES]
    if case not in names:
        parser.error(f"--case: use one of {', '.join(names)}")
    if not 1 <= reps <= MAX_REPS:
        parser.error(f"--reps: a whole number from 1 to {MAX_REPS}")
    import torch

    if not torch.cuda.is_available():
        parser.error(f"no CUDA device: {measures}; run on a CUDA machine")
