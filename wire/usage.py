"""Reading just the token usage and finish reasons of a response body (for metrics and quotas),
skipping everything else."""

from __future__ import annotations

import msgspec
from msgspec import Struct

from wire.openai import Usage


class FinishOnly(Struct):
    finish_reason: str | None = None


class UsageOnly(Struct):
    usage: Usage | None = None
    choices: list[FinishOnly] = []


usage_decoder = msgspec.json.Decoder(UsageOnly)
