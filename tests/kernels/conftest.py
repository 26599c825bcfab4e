"""Kernel tests run the Triton kernels compiled on a CUDA GPU when there is one, else on CPU through
Triton's interpreter (tests/triton_mode.py); the tensors they make are created where the kernels run."""

from tests.triton_mode import DEVICE, GPU

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

_TRITON_MODULES = ("kernels.paged_decode", "kernels.paged_prefill", "kernels.shared_prefix_decode",
                   "kernels.kv_write", "kernels.split_merge", "kernels.triton_helpers")
_early = [name for name in _TRITON_MODULES if name in sys.modules]
assert GPU or not _early, f"{_early} imported before tests/triton_mode.py set TRITON_INTERPRET=1; kernels would compile for CUDA"

pytest.importorskip("triton")

NUM_KV_HEADS = 3
NUM_HEADS = 9  # SmolLM2's GQA 9:3
HEAD_DIM = 64
SCALE = HEAD_DIM**-0.5
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


class PagedKV:
    """A random paged cache plus block tables that scatter each sequence over shuffled blocks."""

    num_heads, num_kv_heads, head_dim, scale = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE

    def __init__(self, block_size: int, dtype: torch.dtype, num_blocks: int = 96, seed: int = 0):
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)  # drawn on CPU (the generator's), then moved
        self.k_cache = torch.randn(shape, generator=self.generator, device="cpu").to(DEVICE, dtype)
        self.v_cache = torch.randn(shape, generator=self.generator, device="cpu").to(DEVICE, dtype)
        self.free_blocks = torch.randperm(num_blocks, generator=self.generator, device="cpu").tolist()

    def block_tables(self, lengths: list[int], width: int | None = None) -> torch.Tensor:
        """[len(lengths), width] int32; padding entries are -1 so a stray read would fault."""
        needed = [-(-n // self.block_size) for n in lengths]
        width = max(needed + [1]) if width is None else width
        table = torch.full((len(lengths), width), -1, dtype=torch.int32)
        for row, count in enumerate(needed):
            table[row, :count] = torch.tensor([self.free_blocks.pop() for _ in range(count)], dtype=torch.int32)
        return table

    def queries(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, NUM_HEADS, HEAD_DIM, generator=self.generator, device="cpu").to(DEVICE, self.k_cache.dtype)


@pytest.fixture(autouse=True)
def on_kernel_device():
    """Tensors a test makes land where the kernels run."""
    with torch.device(DEVICE):
        yield


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture(params=[16, 32], ids=["page16", "page32"])
def block_size(request):
    return request.param


@pytest.fixture
def kv(block_size, dtype) -> PagedKV:
    return PagedKV(block_size, dtype)


@pytest.fixture
def tol(dtype) -> dict:
    return TOLERANCE[dtype]


@pytest.fixture
def two_threads():
    """torch's (and the kernels') threads at 2 for the test, as they were after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiles_restored():
    """The native kernels, their AMX tiles switched back on after a test that turns them off (use_tiles)."""
    from kernels import native  # here, not at the top: this file must not import kernels before triton_mode

    kernels = native.library()
    yield kernels
    kernels.use_tiles(True)


@pytest.fixture
def amx_tiles(tiles_restored):
    """tiles_restored, on a CPU with AMX tiles (skipped elsewhere: hardware, not a missing feature)."""
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles")
    return tiles_restored
