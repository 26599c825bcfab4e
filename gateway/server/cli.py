"""The ``parrot`` command: ``parrot serve`` (gateway + builtin engine), ``parrot engine`` (one engine)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from gateway.config import GatewayConfig, load_config


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parrot serve", description="Run the Parrot gateway.")
    parser.add_argument("--config", help="TOML config file (also PARROT_CONFIG)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--log-level")
    parser.add_argument("--log-format", choices=["text", "json"], help="json: one JSON object per line (also PARROT_LOG_FORMAT)")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                        help="log a line per request (also PARROT_ACCESS_LOG)")
    parser.add_argument("--tracing-exporter", choices=["otlp", "console"],
                        help="send OpenTelemetry spans there (needs the tracing extra; also PARROT_TRACING_EXPORTER)")
    parser.add_argument("--api-key", action="append", dest="api_keys",
                        help="accepted client key; repeat for several (also PARROT_API_KEYS)")
    parser.add_argument("--admin-key", action="append", dest="admin_keys",
                        help="a key that also sees every key's sessions and graphs; repeat for several "
                             "(also PARROT_ADMIN_KEYS)")
    parser.add_argument("--upstream", action="append", default=[], metavar="MODEL=BASE_URL",
                        help="serve MODEL from an OpenAI-compatible server at BASE_URL (ending in /v1)")
    parser.add_argument("--upstream-kv-events", action="append", default=[], metavar="ENDPOINT",
                        help="the KV-cache events endpoint (ZMQ) of the --upstream given in the same position "
                             "('' for none): e.g. tcp://127.0.0.1:5557 for vLLM's --kv-events-config "
                             "endpoint tcp://*:5557 (also PARROT_UPSTREAM_KV_EVENTS, comma-separated)")
    parser.add_argument("--model", dest="builtin_model", help="builtin engine model: HF dir or .gguf file")
    builtin = parser.add_mutually_exclusive_group()
    builtin.add_argument("--builtin", dest="builtin_enabled", action="store_true", default=None,
                         help="start the builtin engine (default: only when no upstream is configured)")
    builtin.add_argument("--no-builtin", dest="builtin_enabled", action="store_false")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the builtin engine's forward compiled by torch.compile (default: on; --no-compile starts "
                             "sooner and decodes slower; also PARROT_ENGINE_COMPILE, [builtin] compile)")
    parser.add_argument("--engine-port", type=int, help="port of the builtin engine process (the first of them)")
    parser.add_argument("--engines", type=int, dest="replicas",
                        help="builtin engine processes to start, on consecutive ports (also PARROT_ENGINES)")
    parser.add_argument("--state", metavar="URL_OR_PATH",
                        help="where sessions, variables and quota counters live: redis://HOST:PORT/DB (shared by "
                             "replicas), a SQLite file's path (the default: state.sqlite3 in the data directory), "
                             "or memory:// (also PARROT_STATE)")
    return parser


def _upstream(spec: str) -> dict[str, str]:
    model, sep, url = spec.partition("=")
    if not sep or not model or not url:
        raise SystemExit(f"--upstream takes MODEL=BASE_URL, got {spec!r}")
    return {"model": model, "base_url": url}


def _upstreams(args: argparse.Namespace) -> list[dict[str, str]]:
    """``--upstream`` specs, each with the ``--upstream-kv-events`` endpoint in its position (or
    PARROT_UPSTREAM_KV_EVENTS's, comma-separated, when no flag gives them)."""
    upstreams = [_upstream(s) for s in args.upstream]
    from_env = os.environ.get("PARROT_UPSTREAM_KV_EVENTS")
    endpoints = args.upstream_kv_events or (from_env.split(",") if from_env else [])
    if len(endpoints) > len(upstreams):
        raise SystemExit(f"{len(endpoints)} KV-events endpoints for {len(upstreams)} --upstream")
    for upstream, endpoint in zip(upstreams, endpoints):
        if endpoint.strip():
            upstream["kv_events"] = endpoint.strip()
    return upstreams


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return load_config(args.config, overrides={
        "server": {"host": args.host, "port": args.port, "log_level": args.log_level, "log_format": args.log_format,
                   "access_log": args.access_log},
        "tracing": {"exporter": args.tracing_exporter, "enabled": True if args.tracing_exporter else None},
        "auth": {"api_keys": args.api_keys, "admin_keys": args.admin_keys},
        "builtin": {"enabled": args.builtin_enabled, "model": args.builtin_model, "port": args.engine_port,
                    "replicas": args.replicas, "compile": args.compile},
        "state": {"url": args.state},
        "upstreams": _upstreams(args),
    })


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # uvicorn re-raises the signal it caught once it has shut down; as SystemExit, `finally` blocks still run.
    raise SystemExit(128 + signum)


def serve(argv: list[str]) -> None:
    import uvicorn

    from gateway.server.app import create_app
    from http_plumbing.http_protocol import HttpProtocol
    from http_plumbing.logs import configure_logging

    config = config_from_args(_serve_parser().parse_args(argv))
    configure_logging(config.server.log_level, config.server.log_format)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    try:
        # The app's lifespan starts the builtin engine process, restarts it if it dies, stops it at exit.
        print(f"Parrot gateway on http://{config.server.host}:{config.server.port}/v1"
              f"{' (builtin engine loading…)' if config.builtin_enabled() else ''}", flush=True)
        uvicorn.run(create_app(config), host=config.server.host, port=config.server.port,
                    log_level=config.server.log_level, log_config=None, access_log=False, loop="uvloop", http=HttpProtocol,
                    timeout_graceful_shutdown=config.server.shutdown_grace_s,
                    proxy_headers=False)  # no proxy in front by default; its per-request middleware costs
    finally:
        logging.getLogger("parrot").info("gateway ran %.0fs", time.monotonic() - started)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": serve, "engine": _engine}
    if not argv or argv[0] not in commands:
        print("usage: parrot {serve,engine} [options]   (parrot COMMAND --help for details)", file=sys.stderr)
        raise SystemExit(2)
    commands[argv[0]](argv[1:])


def _engine(argv: list[str]) -> None:
    from engines.builtin.server.cli import main as engine_main

    engine_main(argv)


if __name__ == "__main__":
    main()
