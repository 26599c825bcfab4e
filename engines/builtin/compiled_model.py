"""The model's forward compiled by torch.compile (inductor), gpt-fast style: `--compile`, CPU.

Why: at 135M parameters much of a bf16 decode step is Python and op dispatch (some 1,200
small ops over 30 layers; `benchmarks/engine_profile.py`, its "ops" column). Inductor fuses the
norms, rope, SiLU and residual adds into a few C++ loops; the linears are the C++ kernel's op in both
(`cpu_linear.py`), and freezing makes the weights the graph's constants.

Attention stays eager behind a custom op: its per-step plans hold host lists that would make a
graph recompile every step. The op reads the step's metadata from the ``CompiledForward`` it was
set on before the forward (as vLLM's forward context does). Where the step's attention is the C++
kernel's and kernels/native/torch_ops.cpp builds, that op is parrot_native::attention, whose C++ body
holds the layers' caches (given at start) and the step's tables (given before each forward): a layer's
call then never reaches Python, whose time in each of the layers' calls added up over a decode step
(``python -m benchmarks.cpp_ops --op attention`` compares the two). The token count and the count of rows the
last layer finishes (those whose logits are wanted) are dynamic; torch specialises size 1, so two
graphs serve: several tokens, and batch-1 decodes (a prompt's chunk finishing one row finishes it twice
in the first, where a graph of its own lengthened the start markedly). Both are
compiled at engine start by a warm-up generation, so no request waits for them; every tensor they are
given is an inference tensor (model_runner.run), or their guards would tell the two kinds apart and
compile again while serving. Decode steps are faster than eager ones with the same tokens, in fp32 and
bf16, most at larger batches; the start takes longer by the compilation (inductor's cache warm), kept down by
specialising the floats the modules hold (the norms' eps, the embedding's norm_type), which as symbols made
dynamo trace each graph twice, and by two graphs rather than three. The figures: docs/engine.md,
"Measurements behind design choices".
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch import nn

from engines.builtin.attention import AttentionMetadata, paged_attention
from engines.builtin.model import CausalLM, rows_to_finish
from kernels import native

# Live compiled forwards by a number of their own (never reused, unlike id()), for the op to find its
# model's caches and step metadata; a graph is compiled with its forward's number as a constant.
_forwards: weakref.WeakValueDictionary[int, CompiledForward] = weakref.WeakValueDictionary()
_numbers = itertools.count()


# Declared with torch.library.Library, as kernels/native_linear.py's op, not with the custom_op decorator, whose
# Python wrapper costs several times more a call (30 calls a decode step).
_library = torch.library.Library("parrot", "FRAGMENT")
_library.define("paged_attention(Tensor q, Tensor k, Tensor v, int forward_id, int layer_index) -> Tensor")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_id: int, layer_index: int) -> torch.Tensor:
    # Writes k and v into the layer's cache, which the graph never sees: the op's output (the next
    # layer's input) keeps the layers in order.
    return _forwards[forward_id].attend(q, k, v, layer_index)


_library.impl("paged_attention", _attention, "CPU")


@torch.library.register_fake("parrot::paged_attention")
def _(q, k, v, forward_id, layer_index):
    return torch.empty_like(q)


_attention_op = torch.ops.parrot.paged_attention


FORWARD_ID_GUARD = "self.forward_id"  # dynamo's name for the guard on _Decoder.forward_id


def _skip_guards_inside_the_model(entries) -> list[bool]:
    """Guards kept: on the inputs, and on the _Decoder's forward_id, which tells compiled models apart
    (each graph has its model's weights frozen in). Those on the modules inside the model are
    dropped: it never changes once built, and checking its 400 modules' attributes before every
    step was a visible share of a batch-1 step."""
    kept = [entry.name == FORWARD_ID_GUARD or not entry.orig_guard.source.is_unspecialized_nn_module()
            for entry in entries]
    if not any(entry.name == FORWARD_ID_GUARD for entry in entries):  # dynamo names its guards otherwise now
        raise RuntimeError(f"no {FORWARD_ID_GUARD!r} guard among the compiled decoder's: it would run for any model")
    return kept


class _Decoder(nn.Module):
    """Token ids and positions to the last layer's hidden states, attention through the op: the C++-bodied
    parrot_native::attention where the step's attention is the C++ kernel's (native/torch_ops.cpp; the
    forward's caches and each step's tables handed to it beforehand), else parrot::paged_attention above."""

    def __init__(self, model: CausalLM, forward_id: int, native_attention: bool):
        super().__init__()
        self.model = model
        self.forward_id = forward_id
        self.attention_op = torch.ops.parrot_native.attention if native_attention else _attention_op

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        forward_id, op = self.forward_id, self.attention_op

        def attend(q, k, v, layer_index: int) -> torch.Tensor:
            return op(q, k, v, forward_id, layer_index)

        return self.model.decoder(input_ids, positions, attend, rows)


class CompiledForward:
    """Called as the model's last_hidden is: (input_ids, positions, meta, logit_rows) -> the last layer's hidden states
    of the logit rows (the head is the caller's: model.logits, or the greedy head's screen)."""

    def __init__(self, model: CausalLM, native_attention: bool = False):
        """native_attention: every step's attention is the C++ kernel's (its PreparedKvWrite and PreparedDecode
        set on the step's metadata), and torch_ops' attention operator is loaded: the graph calls that instead of
        reaching Python for each layer (the time each layer's call spent there)."""
        self.model = model
        # Each layer's attention, looked up once: finding it through the module tree added to each layer's call.
        self._attentions = [layer.self_attn for layer in model.model.layers]
        self.meta: AttentionMetadata | None = None
        number = next(_numbers)
        _forwards[number] = self
        self._number, self.native_attention = number, native_attention
        if native_attention:
            ops = torch.ops.parrot_native
            ops.register_forward(number, [a.k_cache for a in self._attentions], [a.v_cache for a in self._attentions],
                                 [a.scale for a in self._attentions])
            weakref.finalize(self, ops.drop_forward, number)
        # Made once and entered each call: each patch() is a new context variable, which a call's set() would
        # leave in the step thread's context for good (two a step, without bound). Freezing (weights as
        # constants, linears prepacked) is an inductor setting, and those are per thread: set on the thread
        # that may compile (torch.compile's options do not reach it).
        self._inductor_settings = inductor_config.patch(freezing=True, emulate_precision_casts=True)
        # The modules' floats are constants (a traced one restarted the trace, see the module's docstring).
        self._dynamo_settings = dynamo_config.patch(specialize_float=True)
        self._keyed_by_operators = native.keyed_by_operators()
        self._decoder = torch.compile(_Decoder(model, number, native_attention), dynamic=True, fullgraph=True,
                                      options={"guard_filter_fn": _skip_guards_inside_the_model})

    @torch.inference_mode()
    def __call__(self, input_ids, positions, meta: AttentionMetadata, logit_rows):
        self.meta = meta
        if self.native_attention:
            torch.ops.parrot_native.set_step(self._number, meta.kv_write.slots, *meta.native.tables)
        try:
            with self._inductor_settings, self._dynamo_settings, self._keyed_by_operators:
                hidden = self._decoder(input_ids, positions, self._rows(input_ids, logit_rows))
        finally:
            self.meta = None
        return None if logit_rows is None else hidden[:len(logit_rows)]

    @staticmethod
    def _rows(input_ids: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """rows_to_finish, with a lone row of several tokens' step given twice: the several-rows graph then serves it."""
        rows = rows_to_finish(input_ids, logit_rows)
        return rows.repeat(2) if len(rows) == 1 < len(input_ids) else rows

    def attend(self, q, k, v, layer_index: int) -> torch.Tensor:
        attn = self._attentions[layer_index]
        return paged_attention(q, k, v, attn.k_cache, attn.v_cache, self.meta, attn.scale)
