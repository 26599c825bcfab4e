"""torch.compile's cache beside the converted models and kernels (engines/builtin/compile_cache.py), not in /tmp,
which a reboot empties (a cold start then compiles everything again); a TORCHINDUCTOR_CACHE_DIR set by the user wins."""

from __future__ import annotations

import os

from engines.builtin.compile_cache import INDUCTOR_CACHE_ENV, compile_cache_dir, use_compile_cache


def test_the_compile_cache_lives_in_parrots_cache_unless_the_user_names_one(monkeypatch, tmp_path):
    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path / "parrot"))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert use_compile_cache() == tmp_path / "parrot" / "inductor"
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "parrot" / "inductor")  # what inductor reads

    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache_dir() == use_compile_cache() == tmp_path / "mine"
