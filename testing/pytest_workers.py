"""Kiln's test suite in parallel workers: a pytest plugin (pyproject's addopts `-p kiln.testing.pytest_workers`).

Most of the suite's time is Inductor compiling, one Python thread a process, so on a 2-core machine two
pytest-xdist workers finish it in about half the time of one process. Where pytest-xdist is installed (the
`dev` extra) and the command line names no worker count (`-n`, `--numprocesses`, `--dist`, `-p no:xdist`),
the suite runs in `min(cores, MAX_WORKERS)` workers, a test file to a worker (`--dist loadfile`: a file's
module fixtures, such as one compiled SD1.5, are built once), the files handed out in the order
tests/conftest.py sorts them (`--no-loadscope-reorder`). Without pytest-xdist it runs in this
process and says so in the header. `-n 0` runs it in this process too.

Each worker takes its share of the cores for torch's threads (OMP_NUM_THREADS, set before the workers
start, unless set already), and the processes its tests start inherit it: workers times threads never
oversubscribe the machine.
"""
from __future__ import annotations

import importlib.util
import os

MAX_WORKERS = 4  # bounds the memory of many compiling workers on a machine with many cores
_CHOSEN = ("-n", "--numprocesses", "--dist", "no:xdist", "-pno:xdist")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_args(args: list[str]) -> list[str]:
    """The options that run the suite in workers, or none where the command line chose already, where
    pytest-xdist is missing, or where one core would give one worker."""
    if any(arg in _CHOSEN or arg.startswith(("-n", "--numprocesses=", "--dist=")) for arg in args):
        return []
    if importlib.util.find_spec("xdist") is None:
        return []
    workers = min(usable_cores(), MAX_WORKERS)
    # in the order tests/conftest.py gives the files (pytest-xdist would reorder them by their number of tests)
    return ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"] if workers > 1 else []


def pytest_load_initial_conftests(early_config, parser, args):
    extra = worker_args(args)
    args[:] = extra + args
    if extra:  # the workers, and what they start, read it as they import torch
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // int(extra[1]))))
    early_config._kiln_workers = extra


def pytest_report_header(config):
    extra = getattr(config, "_kiln_workers", None)
    if extra:
        return f"kiln: {extra[1]} pytest-xdist workers, a test file to each (testing/pytest_workers.py; -n 0: one process)"
    if importlib.util.find_spec("xdist") is None:
        return "kiln: one process: pytest-xdist is not installed (the dev extra has it), so the suite runs serially"
    return None
