"""Lowering block regions in the background, so that the first image does not wait for the compile.

With `background: true` (CompileOptions), the first call of a region runs its block eagerly and hands
a copy of its inputs to a thread of the model's, which compiles the region on them: the call a region
compiled in the foreground makes (TorchDynamo's capture, Kiln's passes, Inductor, Kiln's cache). It
runs in a copy of the caller's context, so under torch's settings as the model's call has them (torch
keeps them per thread: torch_compat.dynamo.settings_per_thread; with a torch that does not, the regions are
lowered in the foreground, said in the log), and with the caller's grad mode, inference mode, thread
count and CUDA device (TorchDynamo guards on those, and they belong to each thread).
The model meanwhile goes on eagerly, and from its first call after the region's code is ready the
region runs compiled.

One thread per model lowers one region at a time (TorchDynamo compiles one frame at a time anyway:
its compile lock), in the order their first calls handed them in, and goes on while the model is idle
(between ComfyUI's prompts). The inputs wait in host memory (HeldInputs), at most MAX_HELD_BYTES of
them; a region past that runs eagerly and hands its inputs in at a later call. A region lowered here
is measured against eager (compiler/regional/region_choice.py) by its first call while the thread is idle, and
the other regions of its class wait for that: a timing taken beside a lowering would share the cores
with it, and the class's verdict decides whether they are lowered at all. The thread never calls the
model's progress callback: ComfyUI's callback reads, and clears, the user's cancel for the prompt,
which belongs to the model's thread. Each region lowered is logged, and `kiln.wait_lowered(model)`
waits for the thread.

What stays in the foreground, said in the log: a region whose blocks call ComfyUI patches (a patch
may keep state, and the thread would call it once more), and a region compiled again for a new shape
or dtype once its first code is ready (that call waits, as it would without the thread).

A process that exits while a region lowers waits for that lowering to end, and drops the lowerings
still queued (said in the log): the thread is a daemon, and one ended midway inside torch's C++ code
at the interpreter's exit aborts the process ("terminate called without an active exception").

The thread runs at a lower CPU priority than the model's (NICENESS, on Linux), as do the compiler
runs it starts: the host's cores are the model's first, on any device
(docs/measurements/2026-11-28-cpu-background.md has the numbers behind NICENESS).
"""
from __future__ import annotations

import atexit
# imported here, not first by a lowering: each registers a hook with `threading` when imported, which
# raises once the interpreter has begun to exit (a lowering the exit waits for imports Inductor's
# compile, and through it these, and failed with "can't register atexit after shutdown")
import concurrent.futures.process  # noqa: F401
import concurrent.futures.thread  # noqa: F401
import contextlib
import contextvars
import logging
import os
import sys
import threading
import weakref
from typing import Callable, Optional

import torch

from ..shapes.inputs import tensors_in

log = logging.getLogger("kiln")


class CallerState:
    """The thread-local state a capture is guarded on, taken on the model's thread and entered on the
    lowering thread: grad mode, inference mode, the number of CPU threads, the current CUDA device."""

    def __init__(self):
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.threads = torch.get_num_threads()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda_device = torch.cuda.current_device() if cuda else None

    @contextlib.contextmanager
    def entered(self):
        torch.set_num_threads(self.threads)  # per thread under OpenMP: a new thread starts at the default
        cuda = torch.cuda.device(self.cuda_device) if self.cuda_device is not None else contextlib.nullcontext()
        with cuda, torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
            yield


# the lowering thread's CPU priority, as a nice value: below the model's thread (0), not starved
NICENESS = 10


def lower_priority() -> None:
    """The calling thread, and the compiler processes and threads it starts from now on, at NICENESS
    (Linux keeps a nice value per thread, and a child inherits its creator's). Elsewhere a nice value
    is the whole process's: left as it is. An unprivileged thread cannot take it back, so only a
    thread of Kiln's own calls this."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except OSError as exc:  # a sandbox that refuses it: the lowering still runs, at the model's priority
        log.warning("Kiln: the background lowering runs at the model's CPU priority: nice %d was refused (%s)",
                    NICENESS, exc)


MAX_HELD_BYTES = 2 << 30  # the copied inputs held for regions waiting to be lowered, in host memory


class HeldInputs:
    """A region's first inputs, copied into host memory (a GPU's memory is the model's) until the
    thread lowers the region on them: tensors inside tuples, lists and dicts too (a block's rotary
    (cos, sin) tuple, ComfyUI's transformer_options), each given back on its own device and as an
    inference tensor or not, as it came (TorchDynamo guards on both); everything else as it is."""

    DEPTH = 3

    @classmethod
    def bytes_of(cls, args: tuple, kwargs: dict) -> int:
        """What holding these inputs takes, counted before anything is copied."""
        return sum(t.numel() * t.element_size() for t in tensors_in((args, kwargs), cls.DEPTH + 1))

    def __init__(self, args: tuple, kwargs: dict):
        self.nbytes = self.bytes_of(args, kwargs)
        self._args, self._kwargs = (_mapped(value, self.DEPTH, torch.Tensor, _Held) for value in (args, kwargs))

    def given(self) -> tuple[tuple, dict]:
        """The inputs again, on their devices: once, on the lowering thread."""
        return tuple(_mapped(value, self.DEPTH, _Held, _Held.given) for value in (self._args, self._kwargs))


class _Held:
    __slots__ = ("copy", "device", "inference")

    def __init__(self, tensor: torch.Tensor):
        self.device, self.inference = tensor.device, tensor.is_inference()
        self.copy = tensor.detach().to("cpu", copy=True)  # its strides kept (dense tensors: contiguous_inputs)

    def given(self) -> torch.Tensor:
        with torch.inference_mode(self.inference):
            return self.copy.to(self.device, copy=True)


def _mapped(value, depth: int, kind: type, function: Callable):
    """`value` with each `kind` in it, down to `depth` levels of dicts, tuples and lists, replaced by
    `function(item)`; the containers rebuilt, everything else as it is."""
    if isinstance(value, kind):
        return function(value)
    if depth and isinstance(value, dict):
        return {key: _mapped(item, depth - 1, kind, function) for key, item in value.items()}
    if depth and isinstance(value, (tuple, list)):
        return type(value)(_mapped(item, depth - 1, kind, function) for item in value)
    return value


_threads_at_exit: "weakref.WeakSet[LoweringThread]" = weakref.WeakSet()
_exit_hook_registered = False


def _register_for_exit(thread: "LoweringThread") -> None:
    """Have `thread` stopped at the interpreter's exit (LoweringThread.stop_at_exit); the hook that does
    it is registered once a process, when the first thread starts.

    It is registered where `concurrent.futures` registers its own shutdown (`threading._register_atexit`;
    checked: CPython 3.10 - 3.13), after it (this module imports concurrent.futures first), so that it
    runs before it: those hooks run in reverse order, before `atexit`'s. Registered with `atexit`, the
    wait came after concurrent.futures had shut its pools down, and a lowering under way that still
    had kernels to build failed with "cannot schedule new futures after interpreter shutdown" (seen on
    a machine whose Inductor cache was empty). Where the hook cannot be had, `atexit` is used."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("this Python has no threading._register_atexit")
            register(_stop_all_at_exit)
        except RuntimeError:  # none, or the interpreter has begun to exit
            atexit.register(_stop_all_at_exit)
        _exit_hook_registered = True
    _threads_at_exit.add(thread)


def _stop_all_at_exit() -> None:
    for thread in list(_threads_at_exit):
        thread.stop_at_exit()


class LoweringThread:
    """A model's lowering jobs, run one at a time on a thread of their own, each once it is ready
    (`ready()`, asked under the thread's lock): the thread starts when a job is handed in or `wake()`
    finds one ready, runs in a copy of the context of the call that started it, and ends when no job
    left is ready."""

    def __init__(self, label: str):
        self.label = label
        self._lock = threading.Condition()
        self._jobs: list[tuple[str, Callable[[], None], Callable[[], bool], int]] = []
        self._running = False
        self._held = 0      # bytes of inputs held by the jobs queued or under way
        self.lowering = ""  # the job under way ('' when none)
        self._closed = False  # the process is exiting: no job starts any more (stop_at_exit)

    def submit(self, what: str, job: Callable[[], None], ready: Callable[[], bool], nbytes: int = 0) -> bool:
        """Queue `job` (which says its own failures), unless the inputs held for the jobs queued or under
        way would pass MAX_HELD_BYTES with its `nbytes` (a job alone is always taken; none once the
        process exits); start the thread if a job is ready."""
        with self._lock:
            if not self._fits(nbytes):
                return False
            self._held += nbytes
            self._jobs.append((what, job, ready, nbytes))
            self._start_if_ready()
        return True

    def can_hold(self, nbytes: int) -> bool:
        """Inputs of `nbytes` would be taken now (see submit)."""
        with self._lock:
            return self._fits(nbytes)

    def _fits(self, nbytes: int) -> bool:
        """Nothing is taken once the process exits (stop_at_exit)."""
        return not self._closed and (not self._held or self._held + nbytes <= MAX_HELD_BYTES)

    def wake(self) -> None:
        """Start the thread if a job queued has become ready."""
        with self._lock:
            self._start_if_ready()

    def busy(self) -> bool:
        """A job is under way, or about to be."""
        return self._running

    def queued(self) -> list[str]:
        with self._lock:
            return [job[0] for job in self._jobs]

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the thread has run every job that is ready; False when `timeout` (seconds) ran out first."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._running, timeout)

    def stop_at_exit(self) -> None:
        """At the interpreter's exit: drop the jobs queued, take no more, and wait for the one under way,
        if any (it ends lowered, or failed and said so)."""
        with self._lock:
            self._closed = True
            dropped = [job[0] for job in self._jobs]
            self._held -= sum(job[3] for job in self._jobs)
            self._jobs.clear()
            queued = f"{len(dropped)} queued lowering(s) dropped: {', '.join(dropped)}" if dropped else ""
            if self._running and self.lowering:
                log.warning("Kiln: %s: the process exits once the background lowering of %s ends%s", self.label,
                            self.lowering, f" ({queued})" if queued else "")
            elif queued:
                log.warning("Kiln: %s: the process exits; %s", self.label, queued)
            self._lock.wait_for(lambda: not self._running)

    def _start_if_ready(self) -> None:
        if self._closed or self._running or not any(ready() for _, _, ready, _ in self._jobs):
            return
        self._running = True
        _register_for_exit(self)
        # in a copy of the caller's context: torch's settings as the model's call has them (torch_compat.dynamo.settings_per_thread)
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._run,), name=f"kiln-lowering {self.label}", daemon=True).start()

    def _run(self) -> None:
        ended = False
        try:
            lower_priority()
            while not ended:
                ended = self._run_next()
        except BaseException:  # noqa: BLE001  said, not raised into the interpreter's hook of a thread
            log.exception("Kiln: %s: the background lowering stopped; the regions queued wait for the next call "
                          "that hands one in", self.label)
        finally:
            if not ended:  # ended by an error of the thread's own: a waiter must not wait for a dead thread
                with self._lock:
                    self._running, self.lowering = False, ""
                    self._lock.notify_all()

    def _run_next(self) -> bool:
        """Run the first job that is ready; True when none was, and the thread ends (said under the lock
        that `submit` and `wake` take, so a job handed in meanwhile starts a new thread)."""
        with self._lock:
            job = None if self._closed else next((job for job in self._jobs if job[2]()), None)
            if job is None:
                self._running, self.lowering = False, ""
                self._lock.notify_all()
                return True
            self._jobs.remove(job)
            self.lowering = job[0]
        try:
            job[1]()
        except BaseException:  # noqa: BLE001  a job says its own failures; this is the last word
            log.exception("Kiln: %s: lowering %s in the background failed", self.label, self.lowering)
        finally:
            with self._lock:
                self._held -= job[3]
                self.lowering = ""
        return False
