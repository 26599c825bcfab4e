"""``parrot engine``: serve one builtin engine over HTTP, optionally registered with a gateway.

Every ``EngineConfig`` field is a flag (``--block-size``, ``--num-blocks`` ...) whose default is
the config's own, so defaults live in one place. A boolean is a switch with a ``--no-`` form
(``--compile``, ``--no-compile``; ``--no-prefix-caching`` for ``enable_prefix_caching``, as vLLM spells it);
it still takes a value (``--compile true``) as older scripts pass it. Each flag can also be set through the
environment as ``PARROT_ENGINE_<FLAG>`` (``PARROT_ENGINE_BLOCK_SIZE=32``); the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import msgspec

from engines.builtin.config import EngineConfig
from engines.builtin.families import EXIT_UNSUPPORTED_MODEL, checkpoint_refusal

ENV_PREFIX = "PARROT_ENGINE_"
SECRET_ENV = "PARROT_ENGINE_SECRET"


def _env_default(dest: str, default: Any) -> Any:
    return os.environ.get(ENV_PREFIX + dest.upper(), default)


def _env_flag(dest: str) -> bool:
    return os.environ.get(ENV_PREFIX + dest.upper(), "").strip().lower() in ("1", "true", "yes", "on")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parrot engine",
        description="Serve the builtin engine (OpenAI routes + Parrot context primitives).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=_env_default("host", "127.0.0.1"))
    server.add_argument("--port", type=int, default=_env_default("port", 8001))
    server.add_argument("--served-model-name", default=_env_default("served_model_name", None),
                        help="model name clients ask for; None: SmolLM2-135M-Instruct for the default model, else its file/dir stem")
    server.add_argument("--log-level", default=_env_default("log_level", "info"))
    server.add_argument("--log-format", choices=["text", "json"], default=_env_default("log_format", "text"),
                        help="json: one JSON object per line, with the request id")
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=_env_flag("access_log"),
                        help="log a line per request (probes at debug level only)")

    gateway = parser.add_argument_group("gateway registration")
    gateway.add_argument("--gateway-url", default=_env_default("gateway_url", None),
                         help="register with this Parrot gateway and send it heartbeats")
    gateway.add_argument("--advertise-url", default=_env_default("advertise_url", None),
                         help="URL the gateway calls this engine at; None: http://HOST:PORT")
    gateway.add_argument("--name", default=_env_default("name", None), help="engine name at the gateway; None: builtin-PORT")
    gateway.add_argument("--heartbeat-interval", type=float, default=_env_default("heartbeat_interval", 2.0))
    # Not a client key: the gateway's [engines] registration_secret, which reads the same variable.
    # --gateway-api-key: its old name, kept as an alias.
    gateway.add_argument("--gateway-secret", "--gateway-api-key", dest="gateway_secret",
                         help=f"engine secret shared with the gateway: registers with it, and every route but "
                              f"/health then requires it as a bearer token (None: env {SECRET_ENV})")

    engine = parser.add_argument_group("engine (EngineConfig)")
    for field in msgspec.structs.fields(EngineConfig):
        # Parsed as text and converted by msgspec against the field's own type, below.
        flag, switch = f"--{field.name.replace('_', '-')}", field.type is bool
        engine.add_argument(flag, dest=field.name, default=_env_default(field.name, field.default),
                            help=f"EngineConfig.{field.name}", **({"nargs": "?", "const": "true"} if switch else {}))
        if switch:  # --no-prefix-caching for enable_prefix_caching, as vLLM spells it
            negated = field.name.removeprefix("enable_").replace("_", "-")
            engine.add_argument(f"--no-{negated}", dest=field.name, action="store_const", const="false",
                                help=f"EngineConfig.{field.name} = false")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(EngineConfig)}
    try:
        return msgspec.convert(values, EngineConfig, strict=False)  # strict=False: "16" -> 16
    except msgspec.ValidationError as exc:
        raise SystemExit(f"parrot engine: invalid engine option: {exc}") from exc


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from http_plumbing.http_protocol import HttpProtocol
    from http_plumbing.logs import configure_logging

    from engines.builtin.cpu_affinity import keep_off
    from engines.builtin.server.app import GatewayRegistration, create_app

    args = build_parser().parse_args(argv)
    config = engine_config(args)
    refusal = checkpoint_refusal(config.model)
    if refusal:  # before anything loads; a GGUF's architecture is known only once parsed: the app refuses it then
        print(f"parrot engine: {refusal}", file=sys.stderr)
        raise SystemExit(EXIT_UNSUPPORTED_MODEL)
    if config.compute_cores:  # before the server starts its threads: they inherit this thread's cores
        keep_off(config.compute_cores)
    configure_logging(args.log_level, args.log_format)  # the loader reports progress via logging too
    # Its few lifecycle lines (loading, ready, registered) show at any level, as they always did.
    logging.getLogger("parrot.engine").setLevel(logging.INFO)
    registration = None
    if args.gateway_url:
        registration = GatewayRegistration(
            gateway_url=args.gateway_url,
            advertise_url=args.advertise_url or f"http://{args.host}:{args.port}",
            name=args.name or f"builtin-{args.port}",
            heartbeat_interval_s=float(args.heartbeat_interval),
        )

    app = create_app(config, model_name=args.served_model_name, registration=registration,
                     secret=args.gateway_secret or os.environ.get(SECRET_ENV) or None,
                     log=logging.getLogger("parrot.engine").info, access_log=args.access_log)
    try:
        uvicorn.run(app, host=args.host, port=int(args.port), log_level=args.log_level, log_config=None,
                    access_log=False, loop="uvloop", http=HttpProtocol)
    except SystemExit:
        if getattr(app.state, "refusal", None):  # the model's architecture: the supervisor does not retry that
            raise SystemExit(EXIT_UNSUPPORTED_MODEL) from None
        raise


if __name__ == "__main__":
    main()
