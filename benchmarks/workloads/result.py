"""What one run of an app returns, in either mode."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Result:
    seconds: float  # end to end: from the app's first request until it holds its final answer
    output: str  # the final answer (the last call's text; for many users, their answers joined)
    parts: list[str] = field(default_factory=list)  # intermediate outputs in call order, for checks
    calls: int = 0  # LLM calls the app made
    prompt_tokens: list[int] = field(default_factory=list)  # usage.prompt_tokens of each answer that had usage
