"""What a call runs: its steps, each a request whose generated text binds one of the call's outputs, and where
its answer goes. An extension request is one step; a semantic call's template is one completions request per
``{{output:NAME}}``, each prompt the template's text before it. A step's body keeps its placeholders: the
runner fills them from the call's inputs and its earlier steps' outputs (or forks the text before the first)."""

from __future__ import annotations

from typing import Any, NamedTuple

from engines.seam import Route
from gateway.semantic import template
from gateway.semantic.answer import Reply
from gateway.semantic.schema import SemanticCall


class Step(NamedTuple):
    route: Route
    body: dict[str, Any]
    output: str  # the name of the call's output its text binds


class CallSpec(NamedTuple):
    steps: tuple[Step, ...]
    # Fill the first step's shared prefix on its engine while the inputs are generated: an extension request
    # does; a semantic call's template fills it when its first output runs.
    warm: bool = False
    reply: Reply | None = None  # the waiting client's (an extension request's own call); None: nobody waits

    @classmethod
    def of_request(cls, route: Route, body: dict[str, Any], reply: Reply | None) -> CallSpec:
        return cls((Step(route, body, "output"),), warm=True, reply=reply)

    @classmethod
    def of_template(cls, call: SemanticCall, pieces: list[template.Piece]) -> CallSpec:
        """Each output generated in order, seeing the text and the outputs before it."""
        steps, prompt = [], ""
        for piece in pieces:
            if piece.kind == "output":
                output = call.outputs.get(piece.name)
                steps.append(Step("completions", {"model": call.model, "prompt": prompt,
                                                  **(output.sampling() if output else {})}, piece.name))
            prompt += piece.text if piece.kind == "text" else "{{" + piece.name + "}}"
        return cls(tuple(steps))
