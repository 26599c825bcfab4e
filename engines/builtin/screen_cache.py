"""The output head's int8 screen (kernels.native.head_screen) kept on disk, keyed by the head's bytes.

Why: the screen is a pure function of the head's weights, made in float64 row by row at every engine start: about
2 s for SmolLM2's head on this 2-core host, half of a tiny test model's whole start (and ten times that while
another process computes beside it). Read back, it takes milliseconds; hashing the head to find it, ~0.1 s.
The key also covers the code that makes the screen, so a change to it makes new files instead of reading stale ones.
Files go under ``$PARROT_CACHE_DIR/head-screens`` (as the converted models and built kernels), written atomically.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import pickle
import tempfile
from functools import cache
from pathlib import Path

import torch

from engines.builtin.loader import cache_root
from kernels import native

log = logging.getLogger(__name__)


def head_screen(packed_head: torch.Tensor) -> native.HeadScreen | None:
    """native.head_screen(packed_head), from the cache when this head's screen was made before."""
    path = cache_root() / "head-screens" / f"{_digest(packed_head)}.pt"
    if path.exists():
        try:
            return native.HeadScreen(*torch.load(path, weights_only=True))
        except (OSError, RuntimeError, EOFError, TypeError, ValueError, pickle.UnpicklingError) as exc:  # damaged: made again
            log.warning("head screen cache %s unreadable (%s): making it again", path, exc)
    screen = native.head_screen(packed_head)
    if screen is not None:
        _write(path, screen)
    return screen


def _digest(packed_head: torch.Tensor) -> str:
    weights = packed_head.detach().contiguous().view(torch.uint8).numpy()
    key = hashlib.blake2b(digest_size=20)
    key.update(f"{packed_head.dtype}{tuple(packed_head.shape)}{_code_version()}".encode())
    key.update(memoryview(weights).cast("B"))
    return key.hexdigest()


@cache
def _code_version() -> str:
    code = inspect.getsource(native.head_screen) + inspect.getsource(native._screen_rows)
    return hashlib.blake2b(code.encode(), digest_size=8).hexdigest()


def _write(path: Path, screen: native.HeadScreen) -> None:
    scratch = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, scratch = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(descriptor, "wb") as file:
            torch.save(tuple(screen), file)
        os.replace(scratch, path)  # whole or not at all, for engines starting side by side
    except OSError as exc:  # a read-only or full cache costs the next start its time, nothing else
        log.warning("head screen not cached at %s: %s", path, exc)
        if scratch is not None:
            Path(scratch).unlink(missing_ok=True)
