"""The semantic-variable placeholder grammar, shared by the gateway and client code:
``{{name}}``, ``{{input:name}}``, ``{{output:name}}``; names are identifiers (dots and dashes allowed).
Group 1 is the kind ("input", "output" or None for a bare name), group 2 the name."""

from __future__ import annotations

import re

PLACEHOLDER = re.compile(r"\{\{\s*(?:(input|output)\s*:\s*)?([A-Za-z_][\w.\-]*)\s*\}\}")
