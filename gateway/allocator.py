"""The C allocator, told to give large freed blocks back to the OS (Linux, glibc; a no-op elsewhere).

glibc serves a block above its mmap threshold with a mapping of its own, unmapped when freed. But
it raises that threshold to the size of every such block freed (up to 32 MiB), so after the first
multi-MB value is freed the next ones come from the heap, whose pages stay with the process while
anything newer lies above them: a gateway that held a session of 40 × 4 MB values and deleted it
kept most of that memory. A fixed threshold keeps large blocks in their own mappings.
"""

from __future__ import annotations

import ctypes
import sys

_M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
LARGE_BLOCK_BYTES = 1024 * 1024  # smaller blocks (most request and response bodies) stay in the heap


def map_large_blocks_separately(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fixes glibc's mmap threshold; returns whether it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
