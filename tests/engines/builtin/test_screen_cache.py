"""The output head's screen kept on disk by the head's bytes: made once, read back equal, made again for other
weights or a damaged file, and still given when the cache cannot be written."""

from __future__ import annotations

import pytest
import torch

from engines.builtin import screen_cache
from kernels import native


def packed_head(seed: int) -> torch.Tensor:
    return native.pack_linear(torch.randn(256, 64, generator=torch.Generator().manual_seed(seed)))


@pytest.fixture
def made(monkeypatch, tmp_path) -> list[torch.Tensor]:
    """The heads whose screen was computed (not read back), with the cache in tmp_path."""
    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path))
    computed, compute = [], native.head_screen

    def counted(head):
        computed.append(head)
        return compute(head)

    monkeypatch.setattr(native, "head_screen", counted)
    return computed


def test_a_heads_screen_is_made_once_and_read_back_equal(made, tmp_path):
    head = packed_head(0)
    first, second = screen_cache.head_screen(head), screen_cache.head_screen(head.clone())
    assert len(made) == 1 and len(list((tmp_path / "head-screens").glob("*.pt"))) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    screen_cache.head_screen(packed_head(1))  # other weights: their own screen
    assert len(made) == 2


def test_a_damaged_file_is_made_again(made, tmp_path):
    head = packed_head(0)
    expected = screen_cache.head_screen(head)
    (file,) = (tmp_path / "head-screens").glob("*.pt")
    file.write_bytes(b"not a screen")
    again = screen_cache.head_screen(head)
    assert len(made) == 2 and all(torch.equal(a, b) for a, b in zip(expected, again, strict=True))


def test_an_unwritable_cache_still_gives_the_screen(made, tmp_path):
    (tmp_path / "head-screens").write_text("a file where the folder should be")
    assert screen_cache.head_screen(packed_head(0)) is not None
