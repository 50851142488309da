"""Lowering block regions in the background, so that the first image does not wait for the compile.

With `background: true` (CompileOptions), the first call of a region runs its block eagerly and hands
a copy of its inputs to a thread of the model's, which compiles the region on them: the call a region
compiled in the foreground makes (TorchDynamo's capture, Kiln's passes, Inductor, Kiln's cache). It
runs in a copy of the caller's context, so under torch's settings as the model's call has them (torch
keeps them per thread: compat.settings_per_thread; with a torch that does not, the regions are
lowered in the foreground, said in the log), and with the caller's grad mode, inference mode, thread
count and CUDA device (TorchDynamo guards on those, and they belong to each thread).
The model meanwhile goes on eagerly, and from its first call after the region's code is ready the
region runs compiled.

One thread per model lowers one region at a time (TorchDynamo compiles one frame at a time anyway:
its compile lock). A region is handed to it by its own call while the thread is free, so that only
one region's copied inputs are held at once; a region that finds the thread busy runs eagerly and
asks again at its next call. A region lowered here is measured against eager
(compiler/region_choice.py) by its first call while the thread is free, and no other region is
handed in before that: a timing taken beside a lowering would mislead, and the class's verdict must
come before its next region is lowered. The thread never calls the model's progress callback:
ComfyUI's callback reads, and clears, the user's cancel for the prompt, which belongs to the model's
thread. Each region lowered is logged, and `kiln.wait_lowered(model)` waits for the one under way.

What stays in the foreground, said in the log: a region whose blocks call ComfyUI patches (a patch
may keep state, and the thread would call it once more), and a region compiled again for a new shape
or dtype once its first code is ready (that call waits, as it would without the thread).

The thread runs at a lower CPU priority than the model's (NICENESS, on Linux), as do the compiler
runs it starts: on a 2-core CPU at the same priority the steps taken while a region lowered ran
several times slower than eager; at nice 10 they ran near eager's time, and the regions were lowered
within a minute of eight-step prompts ten seconds apart (docs/compile-units.md has the numbers).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
from typing import Callable, Optional

import torch

log = logging.getLogger("kiln")


class CallerState:
    """The thread-local state a capture is guarded on, taken on the model's thread and entered on the
    lowering thread: grad mode, inference mode, the number of CPU threads, the current CUDA device."""

    def __init__(self):
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.threads = torch.get_num_threads()
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

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
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


class LoweringThread:
    """A model's thread for lowering regions: one region at a time, handed in by the region's own call
    while the thread is free (so that one region's copied inputs are held at a time); a region handed
    none runs eagerly and asks again at its next call."""

    def __init__(self, label: str):
        self.label = label
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.lowering = ""  # the region it lowers now ('' when free)

    def try_start(self, what: str, job: Callable[[], None]) -> bool:
        """Start `job` (which says its own failures) on a new thread, unless one is still running."""
        with self._lock:
            if self.busy():
                return False
            self.lowering = what
            # in a copy of the caller's context: torch's settings as the model's call has them (compat.settings_per_thread)
            context = contextvars.copy_context()
            self._thread = threading.Thread(target=context.run, args=(self._run, job), name=f"kiln-lowering {self.label} {what}",
                                            daemon=True)
            self._thread.start()
            return True

    def busy(self) -> bool:
        """A region is being lowered."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the region being lowered now, if any; False when `timeout` (seconds) ran out first."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            lower_priority()
            job()
        except BaseException:  # noqa: BLE001  a job says its own failures; this is the last word
            log.exception("Kiln: %s: lowering %s in the background failed", self.label, self.lowering)
        finally:
            self.lowering = ""
