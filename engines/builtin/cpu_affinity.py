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


def available_cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def pin_compute_threads(cores: tuple[int, ...]) -> None:
    """On the step thread, before its first parallel op: itself on cores[0], each OpenMP worker on the next
    core (through the native library, which shares torch's OpenMP runtime). Without the native library,
    the step thread and the workers it starts share the cores' set."""
    from kernels import native

    os.sched_setaffinity(0, cores)
    kernels = native.library()
    if kernels is None or not kernels.pin_threads(cores):
        log.warning("intra-op threads share cores %s without one core each (the native kernels are not built)", cores)


def keep_off(cores: tuple[int, ...]) -> None:
    """The calling thread (and the threads it starts later: the HTTP server's) on the process's other
    cores, where it has any; else it stays where it was (a 2-core box computing on both)."""
    others = available_cores() - set(cores)
    if others:
        os.sched_setaffinity(0, others)
