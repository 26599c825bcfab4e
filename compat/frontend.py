"""Semantic functions, in the spirit of Parrot's PFunc: a docstring is a prompt template that runs on
the gateway, and calling the function submits it and returns its output Variables at once, so a whole
app is submitted before any result exists.

    @semantic_function(model="SmolLM2-135M-Instruct", temperature=0)
    def summarize(text: Input, summary: Output(max_tokens=32)):
        '''Summarize in one sentence: {{text}}
        Summary: {{summary}}'''

    @native
    def shout(text: str) -> str:
        return text.upper()

    with Session(client):
        loud = shout(summarize(text=document))   # nothing has run yet
        print(loud.get())

Parameters are inputs unless annotated ``Output`` (or ``Output(max_tokens=…, stop=…)``); the template may
also spell them ``{{input:name}}`` / ``{{output:name}}``. Inputs take a str (a literal) or a Variable.
Semantic functions need a sync ``OpenAI`` client; their Variables can still be awaited with ``aget``.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable


from compat.openai import Session, Variable, native, session_of  # noqa: F401  (native: re-exported for @native)
from wire.placeholders import PLACEHOLDER



class Input:
    """Annotation: this parameter is an input (a str or a Variable). Unannotated parameters are inputs too."""


class Output:
    """Annotation: this parameter names an output; ``Output(max_tokens=…)`` carries its sampling."""

    def __init__(self, **sampling: Any):
        self.sampling = sampling


def _output_sampling(parameter: inspect.Parameter) -> dict[str, Any] | None:
    """The parameter's sampling if it is an output (by annotation or default), else None."""
    for marker in (parameter.annotation, parameter.default):
        if marker is Output:
            return {}
        if isinstance(marker, Output):
            return dict(marker.sampling)
    return None


class SemanticFunction:
    """A prompt template with typed inputs and outputs; calling it submits a ``/v1/semantic_calls``."""

    def __init__(self, fn: Callable[..., Any], *, model: str | None, criteria: str | None,
                 sampling: dict[str, Any]):
        functools.update_wrapper(self, fn)
        if not fn.__doc__:
            raise ValueError(f"semantic function {fn.__name__} needs its prompt template as docstring")
        self.model = model
        self.criteria = criteria
        signature = inspect.signature(fn, eval_str=True)
        declared = {name: _output_sampling(p) for name, p in signature.parameters.items()}
        self.template, self.outputs = self._parse(inspect.cleandoc(fn.__doc__), declared, sampling)
        self.signature = signature.replace(parameters=[
            p.replace(annotation=inspect.Parameter.empty) for name, p in signature.parameters.items()
            if name not in self.outputs])

    @staticmethod
    def _parse(docstring: str, declared: dict[str, dict | None], defaults: dict[str, Any]
               ) -> tuple[str, dict[str, dict[str, Any]]]:
        """The gateway template (outputs spelled ``{{output:NAME}}``) and each output's sampling, in order."""
        outputs: dict[str, dict[str, Any]] = {}

        def rewrite(match: re.Match) -> str:
            kind, name = match.group(1), match.group(2)
            is_output = kind == "output" or (kind is None and declared.get(name) is not None)
            if is_output:
                outputs[name] = {**defaults, **(declared.get(name) or {})}
                return "{{output:" + name + "}}"
            if name not in declared:
                raise ValueError(f"template placeholder {{{{{name}}}}} is not a parameter")
            return "{{input:" + name + "}}"

        template = PLACEHOLDER.sub(rewrite, docstring)
        if not outputs:
            raise ValueError("a semantic function's template needs at least one output placeholder")
        return template, outputs

    def __call__(self, *args: Any, session: Session | None = None, **kwargs: Any) -> Any:
        """Submit; returns the output Variable (or a tuple of them in template order) without waiting."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        session = session_of(session, bound.arguments.values())
        model = self.model or session.model
        if model is None:
            raise ValueError(f"{self.__name__}: no model (give semantic_function(model=...) or Session(model=...))")
        inputs = {name: value if isinstance(value, Variable) else str(value)
                  for name, value in bound.arguments.items()}
        variables = session.semantic_call(model, self.template, inputs=inputs, outputs=self.outputs,
                                          criteria=self.criteria)
        results = tuple(variables[name] for name in self.outputs)
        return results[0] if len(results) == 1 else results


def semantic_function(fn: Callable[..., Any] | None = None, *, model: str | None = None,
                      criteria: str | None = None, **sampling: Any) -> Any:
    """Decorator: the function's docstring becomes a semantic call; ``sampling`` applies to every output
    (an ``Output(...)`` annotation overrides it per output)."""
    if fn is None:
        return lambda f: SemanticFunction(f, model=model, criteria=criteria, sampling=sampling)
    return SemanticFunction(fn, model=model, criteria=criteria, sampling=sampling)
