"""How a gateway starts the builtin engine as a process beside itself: the engine's own command-line
reading (to know the model it will serve before it registers) and its entry point. Nothing here loads
a model or imports torch."""

from engines.builtin.cli import SECRET_ENV, build_parser, engine_config
from engines.builtin.cli import main as run_engine
from engines.builtin.config import served_model_name

__all__ = ["SECRET_ENV", "build_parser", "engine_config", "run_engine", "served_model_name"]
