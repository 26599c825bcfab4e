"""vLLM's extra sampling fields: passed on to upstream engines, refused by the builtin engine (which does
not implement them) rather than silently ignored."""

from __future__ import annotations

from typing import Any, Annotated

from msgspec import Meta

from wire.sampling import SamplingWithHints

VLLM_EXTRAS = ("min_tokens", "allowed_token_ids", "bad_words", "include_stop_str_in_output", "prompt_logprobs",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class VLLMSampling(SamplingWithHints, kw_only=True, omit_defaults=True):
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unimplemented_extras(self) -> list[str]:
        """The vLLM extras set to something that would change the output."""
        # Empty or false means unset (vLLM's own defaults, as clients dumping a full request send them);
        # prompt_logprobs 0 still asks for the prompt's own logprobs.
        return [name for name in VLLM_EXTRAS
                if (getattr(self, name) is not None if name == "prompt_logprobs" else getattr(self, name))]
