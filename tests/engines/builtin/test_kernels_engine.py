"""The engine over kernels.dispatch: the Triton kernels (compiled on a GPU, else interpreted) give the same greedy
tokens as the torch path, forked contexts decode through the shared-prefix kernel, and prefix
caching can be switched off."""

from __future__ import annotations

import asyncio

from tests.triton_mode import DEVICE

import pytest  # noqa: E402
import torch  # noqa: E402

from engines.builtin.model_runner import ModelRunner  # noqa: E402
from engines.builtin.types import SamplingParams  # noqa: E402
from kernels import dispatch  # noqa: E402

MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TRITON_LAUNCHERS = {
    "kv_write": ("kernels.kv_write", "kv_write"),
    "prefill": ("kernels.paged_prefill", "paged_prefill"),
    "decode": ("kernels.paged_decode", "paged_decode"),
    "shared_prefix": ("kernels.shared_prefix_decode", "shared_prefix_decode"),
}


@pytest.fixture
def make_engine(make_engine):
    """The conftest's, with the engine on the device the kernels run on."""
    return lambda **overrides: make_engine(**{"device": str(DEVICE), **overrides})


def random_tokens(lengths, seed) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]


async def collect(stream) -> list[int]:
    return [event.token_id async for event in stream]


async def concurrent_prompts(engine, prompts) -> list[list[int]]:
    return await asyncio.gather(*(collect(engine.generate_from_prompt(p, GREEDY)) for p in prompts))


async def forked_generations(engine, prefix, suffixes) -> list[list[int]]:
    """Children of one filled context decode together, sharing its full blocks."""
    parent = await engine.fill(prefix)
    outputs = await asyncio.gather(
        *(collect(engine.generate_from_prompt(s, GREEDY, parent_context_id=parent.context_id)) for s in suffixes)
    )
    await engine.free_context(parent.context_id)
    return outputs


@pytest.fixture
def triton_calls(monkeypatch) -> dict[str, int]:
    """Sends attention to the Triton kernels and counts each launcher's calls."""
    pytest.importorskip("triton")
    import importlib

    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    calls = dict.fromkeys(TRITON_LAUNCHERS, 0)
    for name, (module_name, function) in TRITON_LAUNCHERS.items():
        module = importlib.import_module(module_name)
        launcher = getattr(module, function)

        def counted(*args, _name=name, _launcher=launcher, **kwargs):
            calls[_name] += 1
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(module, function, counted)
    return calls


@pytest.fixture
def shared_prefix_calls(monkeypatch) -> list[torch.Tensor]:
    """Records the prefix_ids of every step whose decodes go through shared-prefix attention (the C++
    kernel, prepared for the step, or dispatch's)."""
    seen = []
    original = ModelRunner.prepare

    def recorded(self, batch):
        prepared = original(self, batch)
        if (shared := prepared[2].shared_prefix) is not None:
            seen.append(shared.prefix_ids.clone())
        return prepared

    monkeypatch.setattr(ModelRunner, "prepare", recorded)
    return seen


@pytest.mark.timeout(120)
async def test_triton_engine_matches_torch_path(make_engine, triton_calls, monkeypatch):
    prompts = random_tokens((1, 9, 20), seed=3)
    prefix, *suffixes = random_tokens((37, 4, 1, 11), seed=4)  # 37: two full shared blocks + a copied rest

    with monkeypatch.context() as torch_path:
        torch_path.delenv(dispatch.BACKEND_ENV)
        reference = make_engine(num_blocks=64)
        expected = await concurrent_prompts(reference, prompts)
        expected_forks = await forked_generations(reference, prefix, suffixes)
    assert not any(triton_calls.values()), "the reference engine ran Triton kernels"

    engine = make_engine(num_blocks=64)
    assert engine.runner.min_shared_tokens == 0  # every prefix group goes to the shared-prefix kernel
    assert await concurrent_prompts(engine, prompts) == expected
    assert await forked_generations(engine, prefix, suffixes) == expected_forks
    assert all(triton_calls.values()), triton_calls


async def test_forks_decode_through_one_shared_prefix(make_engine, shared_prefix_calls, tiny_hf_model):
    engine = make_engine()
    engine.runner.min_shared_tokens = 0  # CPU waits for long prefixes, for speed; its torch path is exact too
    prefix, *suffixes = random_tokens((40, 3, 7, 1), seed=5)
    outputs = await forked_generations(engine, prefix, suffixes)
    for suffix, output in zip(suffixes, outputs):
        full = torch.tensor([prefix + suffix])
        expected = tiny_hf_model.generate(full, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        assert output == expected[0, full.shape[1] :].tolist()
    # All three children decoded in one batch against one prefix (two full blocks of 16).
    assert any(ids.tolist() == [0, 0, 0] for ids in shared_prefix_calls), shared_prefix_calls


async def test_unrelated_sequences_take_the_paged_decode_path(make_engine, shared_prefix_calls):
    engine = make_engine(enable_prefix_caching=False)
    engine.runner.min_shared_tokens = 0
    await concurrent_prompts(engine, random_tokens((20, 33), seed=6))
    assert shared_prefix_calls == []


@pytest.mark.parametrize("enabled", [True, False], ids=["prefix-caching", "no-prefix-caching"])
async def test_prefix_caching_switch(make_engine, enabled):
    engine = make_engine(enable_prefix_caching=enabled)
    prompt = random_tokens((40,), seed=7)[0]
    first = await concurrent_prompts(engine, [prompt])
    assert engine.stats().prefix_hit_tokens == 0
    assert await concurrent_prompts(engine, [prompt]) == first
    hits = engine.stats().prefix_hit_tokens
    assert (hits == 32 if enabled else hits == 0), hits  # two full blocks of 16 when on
    assert (engine.stats().cached_tokens > 0) == enabled


@pytest.mark.parametrize(
    ("argv", "enabled"),
    [([], True), (["--no-prefix-caching"], False), (["--enable-prefix-caching", "false"], False)],
)
def test_prefix_caching_flags(argv, enabled):
    from engines.builtin.server.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(argv)).enable_prefix_caching is enabled


async def test_cpu_steps_run_the_cpp_kernels_prepared_once_per_step(make_engine, monkeypatch, tiny_hf_model):
    """On CPU with the C++ kernels built, a step's KV writes and attention (its prefill too) take the arguments
    prepared for the step (not dispatch's per-layer checks), and greedy output still equals HF's."""
    from kernels import native

    if DEVICE.type != "cpu" or native.library() is None:
        pytest.skip("the C++ kernels serve CPU engines only")
    calls: dict[int, tuple[str, int]] = {}  # per prepared object: its kind, its calls
    alive = []  # the objects themselves, so that no id is reused
    for cls, kind in ((native.PreparedDecode, "decode"), (native.PreparedKvWrite, "write")):
        original = cls.__call__

        def counted(self, *args, _original=original, _kind=kind):
            if id(self) not in calls:
                alive.append(self)
            calls[id(self)] = (_kind, calls.get(id(self), (_kind, 0))[1] + 1)
            return _original(self, *args)

        monkeypatch.setattr(cls, "__call__", counted)
    monkeypatch.setattr(dispatch, "decode_attention", lambda *a, **k: pytest.fail("dispatch's decode ran"))
    monkeypatch.setattr(dispatch, "write_kv", lambda *a, **k: pytest.fail("dispatch's KV write ran"))
    monkeypatch.setattr(dispatch, "prefill_attention", lambda *a, **k: pytest.fail("dispatch's prefill ran"))
    engine = make_engine()
    prompt = random_tokens((21,), seed=8)[0]
    output = (await concurrent_prompts(engine, [prompt]))[0]
    expected = tiny_hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    assert output == expected[0, len(prompt):].tolist()
    layers = len(engine.runner.model.model.layers)
    assert layers > 1
    # One preparation of each a step (the prefill's and MAX_TOKENS - 1 decodes'), called by every layer.
    assert [count for kind, count in calls.values() if kind == "write"] == [layers] * MAX_TOKENS
    assert [count for kind, count in calls.values() if kind == "decode"] == [layers] * MAX_TOKENS
