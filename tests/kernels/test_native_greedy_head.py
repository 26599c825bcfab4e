"""The screened greedy head (kernels/native/greedy_head.cpp): each row's token is the argmax of the full head's logits
as the linear kernel computes them (argmax_rows over linear()), ties and near-ties included, and it declines (None)
what it cannot answer so that the caller computes the full head."""

from functools import cache

import pytest
import torch

from kernels import native, native_linear
from tests.kernel_markers import needs_bf16

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]


def _head(vocab: int, in_features: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(vocab, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def _full_argmax(kernels, x: torch.Tensor, packed: torch.Tensor) -> list[int]:
    return kernels.argmax_rows(kernels.linear(x, packed, None).float())


@cache  # building a screen takes most of a case's time; the cases differ in their inputs, not in their head
def _screened_head(in_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    packed = native.pack_linear(_head(16384, in_features, dtype, seed=in_features))  # 512 blocks: a quarter holds 16 rows' candidates
    return packed, native.head_screen(packed)


# 1-8 rows: one screening pass; 9-16: two (8 rows a pass on AVX-512); 3 and 7 leave the linear's unrolled passes
# remainders. 90 inputs: an odd number of pairs, and small enough that the input's integers are int16's largest;
# 576 (SmolLM2's): the input's integers limited so that a sum stays within int32, and bf16 on AMX tiles where the CPU
# has them (whole tiles of 32 inputs).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16])
@pytest.mark.parametrize("in_features", [90, 576])
def test_tokens_equal_the_full_heads_argmax(kernels, two_threads, dtype, rows, in_features):
    packed, screen = _screened_head(in_features, dtype)
    for seed in range(4):
        # Hidden states with a few large dimensions, as a model's have: the input's rounding to integers then counts.
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(100 * rows + seed))
        x[:, seed::23] *= 30
        x = x.to(dtype)

        assert kernels.screened_argmax(x, packed, screen) == _full_argmax(kernels, x, packed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_and_near_ties_to_the_exact_logit(kernels, dtype):
    head = _head(2048, 64, dtype, seed=0)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    signs = x.float().sign()
    aligned = [(signs[r] * 0.2).to(dtype) for r in range(3)]  # each row's largest logit among entries of size 0.2
    head[[700, 40, 1500]] = aligned[0]  # exact ties for row 0, the later ones in other blocks and lanes: the first
    # Rows 1 and 2 each lead with a pair that differs in one entry by less than an int8 code's step, where row 0's
    # sign differs (so the pair stays below row 0's ties): only the exact logit tells the pair apart.
    for row, (first, bump) in zip((1, 2), ((300, 2.0**-6), (1201, 2.0**-7))):
        d = int((signs[row] != signs[0]).nonzero()[row - 1])
        near = aligned[row].clone()
        near[d] = near[d] * (1 + bump)
        head[first], head[first + 1] = (aligned[row], near) if row == 1 else (near, aligned[row])
    packed = native.pack_linear(head)

    tokens = kernels.screened_argmax(x, packed, native.head_screen(packed))

    assert tokens == _full_argmax(kernels, x, packed)
    # Row 0's ties: the first. Rows 1 and 2: the pair's larger exact logit in fp32; bf16 logits round the pair's
    # difference away (a tie again: the first of the pair).
    assert tokens == ([40, 301, 1201] if dtype == torch.float32 else [40, 300, 1201])


def test_declines_what_it_cannot_answer(kernels):
    packed = native.pack_linear(_head(256, 32, torch.float32, seed=2))
    screen = native.head_screen(packed)
    # Seeded: about a quarter of random inputs have top logits close enough that the screen leaves them to the full
    # head (None), which the last line would take for a failure.
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    nan, inf = x.clone(), x.clone()
    nan[1, 3], inf[0, 0] = float("nan"), float("inf")

    assert kernels.screened_argmax(torch.randn(native.MAX_SCREENED_ROWS + 1, 32), packed, screen) is None
    assert kernels.screened_argmax(nan, packed, screen) is None  # torch's argmax picks a NaN: the full head answers
    assert kernels.screened_argmax(inf, packed, screen) is None
    assert kernels.screened_argmax(x.t().contiguous().t(), packed, screen) is None  # columns apart
    assert kernels.screened_argmax(x[:, :30].contiguous(), packed, screen) is None  # another width
    assert kernels.screened_argmax(x, packed, screen) == _full_argmax(kernels, x, packed)


def test_declines_a_step_with_too_many_candidates(kernels):
    """A head whose 4,096 rows are all the same: every row may be the largest, 128 blocks to compute exactly, more
    than the full head costs."""
    packed = native.pack_linear(_head(1, 32, torch.float32, seed=4).expand(4096, 32).contiguous())
    assert kernels.screened_argmax(torch.randn(1, 32), packed, native.head_screen(packed)) is None


def test_no_screen_for_a_head_that_is_not_finite_or_has_an_odd_width(kernels):
    head = _head(64, 32, torch.float32, seed=3)
    head[5, 7] = float("inf")

    assert native.head_screen(native.pack_linear(head)) is None
    assert native.head_screen(native.pack_linear(_head(64, 33, torch.float32, seed=3))) is None


def test_sums_at_the_integer_limit_and_zero_rows(kernels):
    """Every input at its largest magnitude, signed as the codes of a row at +-127 (its integer sum at the most int32
    may hold at 576 inputs), and all-zero head rows (scale 0: their logit is 0 exactly, never a spread-out bound)."""
    head = _head(512, 576, torch.float32, seed=5)
    head[64:128] = 0
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(6))
    head[300] = x[0].sign() * head.abs().max()  # codes all +-127, aligned with row 0's signs
    x[0] = x[0].sign() * 3.0  # every |x_k| the row's largest: each integer at its limit
    x[1] = -x[1].abs()  # row 1: the zero rows' 0 may lead when every other logit is negative
    head[:64] = head[:64].abs()
    packed = native.pack_linear(head)
    screen = native.head_screen(packed)

    assert (screen.scales[64:128] == 0).all() and (screen.radii[64:128] < 1e-30).all()
    assert kernels.screened_argmax(x, packed, screen) == _full_argmax(kernels, x, packed)
    assert kernels.screened_argmax(x, packed, screen)[0] == 300


def test_the_exact_blocks_are_the_engines_linear_bit_for_bit(kernels):
    """The screen computes its candidates' blocks with the kernels library's linear (kernels.linear); the engine's head
    runs native_linear.ops()'s operator, built apart with torch's headers (native/torch_ops.cpp): the same logits."""
    weight = _head(1024, 576, torch.float32, seed=7)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(8))
    packed = native.pack_linear(weight)
    for rows in (1, 5, 16):
        assert torch.equal(kernels.linear(x[:rows], packed, None), native_linear.ops()[0](x[:rows], packed, None))
