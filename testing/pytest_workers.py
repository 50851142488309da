"""Kiln's test suite in parallel workers: a pytest plugin (pyproject's addopts `-p kiln.testing.pytest_workers`).

Most of the suite's time is Inductor compiling, one Python thread a process, so on a 2-core machine two
pytest-xdist workers finish it in about half the time of one process. Where pytest-xdist is installed (the
`dev` extra) and the command line names no worker count (`-n`, `--numprocesses`, `--dist`, `-p no:xdist`),
the suite runs in `min(cores, MAX_WORKERS)` workers, a test file to a worker (`--dist loadfile`: a file's
module fixtures, such as one compiled SD1.5, are built once), the files handed out in the order
`work_order` gives them (`--no-loadscope-reorder`). Without pytest-xdist it runs in this
process and says so in the header. `-n 0` runs it in this process too.

Each worker takes its share of the cores for torch's threads (OMP_NUM_THREADS, set before the workers
start, unless set already), and the processes its tests start inherit it: workers times threads never
oversubscribe the machine.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

MAX_WORKERS = 4  # bounds the memory of many compiling workers on a machine with many cores
SLOW_TEST_WEIGHT = 50   # a `slow` test (a whole model through Inductor) weighs this many other tests
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
    # in the order work_order gives the files (pytest-xdist would reorder them by their number of tests)
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


@dataclass(frozen=True)
class FileWork:
    """One test file as the ordering sees it."""
    path: object
    tests: int
    slow: int               # of them marked `slow`
    trained_denoiser: bool  # marked `trained_denoiser`: needs the denoiser trained once into the cache

    @property
    def weight(self) -> int:
        return self.tests - self.slow + SLOW_TEST_WEIGHT * self.slow


def work_order(files: list[FileWork]) -> list:
    """The files' paths in the order the workers take them: the first `trained_denoiser` file first (on a
    fresh machine one worker trains the denoiser while the others run the rest of the suite); then the
    other files, the heaviest first (each `slow` test weighing SLOW_TEST_WEIGHT others), so the last files
    handed out are short and no worker finishes long before the others; the other `trained_denoiser`
    files last, so no worker sits waiting on the training lock."""
    marked = [f for f in files if f.trained_denoiser]
    rest = sorted((f for f in files if not f.trained_denoiser), key=lambda f: -f.weight)
    return [f.path for f in marked[:1] + rest + marked[1:]]


def pytest_collection_modifyitems(config, items):
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    work = [FileWork(path, len(tests), sum(1 for t in tests if t.get_closest_marker("slow")),
                     tests[0].get_closest_marker("trained_denoiser") is not None) for path, tests in files.items()]
    items[:] = [item for path in work_order(work) for item in files[path]]
