"""The cores an engine computes on (``EngineConfig.cpu_cores``): its intra-op threads one to a core, its
HTTP server's threads on the process's other cores.

Why: the step thread and torch's OpenMP workers stream weights core by core; a thread the OS moves
to another core, or a request's tokenizing on a core a worker needs, stalls the whole step (every
parallel region waits for its slowest thread). vLLM-CPU binds its OpenMP threads the same way
(``VLLM_CPU_OMP_THREADS_BIND``) and keeps its API server off them (``VLLM_CPU_NUM_OF_RESERVED_CPU``).
Linux only (``os.sched_setaffinity`` sets the calling thread's mask; threads it starts inherit it).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# The process's cores as it started, before any thread here was pinned (a thread's own mask may be narrower).
PROCESS_CORES = frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))
CAN_PIN = hasattr(os, "sched_setaffinity")


def parse_cores(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6): the cores in the order given, each once; ValueError when malformed."""
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        last = last if dash else first
        if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
            raise ValueError(f"cpu_cores {text!r}: expected core numbers and ranges such as '0-3,6'")
        cores.extend(core for core in range(int(first), int(last) + 1) if core not in cores)
    return tuple(cores)


class ComputeThreads:
    """The step thread's side: ``pin()`` before every step keeps the step thread and each OpenMP worker on
    its core (through the native library, which shares torch's OpenMP runtime), re-pinning any worker the
    runtime made since; a step that finds every thread in place pays one parallel region, no system call.
    Without the native library the step thread and the workers it starts share the cores' set."""

    def __init__(self, cores: tuple[int, ...]):
        self.cores = cores
        self._warned = False

    def pin(self) -> None:
        from kernels import native

        kernels = native.library()
        status = kernels.pin_threads(self.cores) if kernels is not None else None
        if status == 0:
            return
        if status is None or status == -2:
            self._share_the_set()
        self._warn_once({None: "the native kernels are not built: the intra-op threads share cores %s",
                         -1: "pinning an intra-op thread to its core (of %s) failed",
                         -2: "this platform cannot pin OpenMP threads: they share cores %s",
                         -3: "OpenMP gave fewer threads than cores %s: some cores compute nothing"}[status])

    def _share_the_set(self) -> None:
        try:
            os.sched_setaffinity(0, self.cores)
        except OSError as exc:
            self._warn_once(f"the step thread could not be moved onto cores %s: {exc}")

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message, self.cores)


def keep_off(cores: tuple[int, ...]) -> None:
    """The calling thread (and the threads it starts later: the HTTP server's, the model loader's) on the
    process's other cores, where it has any; else it stays where it was (a 2-core box computing on both)."""
    if others := PROCESS_CORES - set(cores):
        os.sched_setaffinity(0, others)
