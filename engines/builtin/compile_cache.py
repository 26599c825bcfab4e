"""Where torch.compile (inductor) keeps what it compiled: beside the converted models and built kernels.

Inductor's own default is a folder under /tmp, which a reboot or a tmp cleaner empties; the next start then
compiles everything again (the cold start in docs/engine.md, "Compiled by default"). A TORCHINDUCTOR_CACHE_DIR set
by the user wins.
"""

from __future__ import annotations

import os
from pathlib import Path

from engines.builtin.loader import cache_root

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> Path:
    return Path(os.environ.get(INDUCTOR_CACHE_ENV) or cache_root() / "inductor")


def use_compile_cache() -> Path:
    """Points inductor at compile_cache_dir(). Called before torch._inductor is first imported: that import sets
    the variable to inductor's /tmp default, which would then read as the user's choice."""
    directory = compile_cache_dir()
    os.environ[INDUCTOR_CACHE_ENV] = str(directory)
    return directory
