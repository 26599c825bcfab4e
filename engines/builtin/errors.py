"""The builtin engine core's domain errors.

Torch-free on purpose: the serving layer translates them (by class) into OpenAI error answers
without importing the core's heavy dependencies.
"""


class ContextNotFound(KeyError):
    """No context with that id (never created, or freed)."""


class PromptTooLong(ValueError):
    """The context would exceed the model's maximum length."""


class ContextBusy(RuntimeError):
    """A fill or generation is already running on that context."""


class UnsupportedArchitecture(ValueError):
    """The checkpoint's architecture is not one the engine's model implements (named in the message)."""
