"""The builtin engine's OpenAI surface over its core, one noun per file:

builtin_engine.py  BuiltinEngine: its surfaces below, its health, stats and metrics
chat.py            chat completions (templates, tools, structured output)
completions.py     legacy completions (several prompts, echo, prompt scoring)
contexts.py        Parrot's context primitives and their request bodies
model_serving.py   what the surfaces share: tokenizer, limits, running prompt jobs (n choices as forks)
choices.py         token events -> text pieces (detokenizing, stop strings, the one finish), usage
sampling.py        request fields -> the core's SamplingParams
logprobs.py        logprobs as OpenAI writes them
merge.py           several streams as one
errors.py          the one translation of the core's errors into the seam's
"""

from engines.builtin.serving.builtin_engine import BuiltinEngine
from engines.builtin.serving.contexts import (
    ContextFillRequest,
    ContextGenerateRequest,
    ContextGeneration,
    ContextGenerationChunk,
    ContextTrimRequest,
)
from engines.builtin.serving.errors import EngineBadRequest, EngineConflict, EngineNotFound

__all__ = ["BuiltinEngine", "ContextFillRequest", "ContextGenerateRequest", "ContextGeneration",
           "ContextGenerationChunk", "ContextTrimRequest", "EngineBadRequest", "EngineConflict", "EngineNotFound"]
