"""The builtin engine process the gateway runs beside itself: started, watched, reaped, restarted, stopped.

The engine computes in its own process so that model work never touches the gateway's event loop.
It registers with the gateway over HTTP like any engine, with a secret made for it alone (never a
client key: the child's environment holds none). When it dies, its records go at once (requests get
a clean 503 rather than connection errors, /health turns degraded) and it is started again after a
backoff that doubles per quick failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time

# The one place the gateway reads the builtin engine's own modules (torch-free): its command line, to know the model
# it will serve before it registers. Through the seam this would make engines.seam depend on engines.builtin.
from engines.builtin.server.cli import SECRET_ENV, build_parser, engine_config
from engines.builtin.config import served_model_name
from engines.builtin.families import EXIT_UNSUPPORTED_MODEL, checkpoint_refusal
from gateway.config import GatewayConfig, secret_env_vars
from gateway.registry import EngineRegistry, url_key

log = logging.getLogger("parrot.supervisor")

# Every secret setting's variable and the file that may hold them (config.secret_env_vars), and the old way
# a client key reached the engine: never in its environment.
HIDDEN_ENV = frozenset({*secret_env_vars(), "PARROT_GATEWAY_API_KEY"})


def _die_with_parent() -> None:
    """Linux: the engine gets SIGTERM when the gateway process dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class EngineSupervisor:
    def __init__(self, config: GatewayConfig, registry: EngineRegistry, replica: int = 0):
        """``replica``: which of ``[builtin] replicas`` processes this is; it listens on ``port + replica``."""
        builtin, server = config.builtin, config.server
        self._builtin = builtin
        self._registry = registry
        self.secret = secrets.token_urlsafe(32)
        port = builtin.port + replica
        self.url = f"http://{builtin.host}:{port}"
        gateway_host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
        self._command = [sys.executable, "-m", "gateway.server.cli", "engine", "--host", builtin.host,
                         "--port", str(port), "--gateway-url", f"http://{gateway_host}:{server.port}",
                         "--advertise-url", self.url, "--log-format", server.log_format]
        if server.access_log:
            self._command.append("--access-log")
        if builtin.model:
            self._command += ["--model", builtin.model]
        if builtin.served_model_name:
            self._command += ["--served-model-name", builtin.served_model_name]
        # The child's own reading of its arguments (and PARROT_ENGINE_* variables): the model it will
        # serve, known before it registers. Invalid engine options stop the gateway's start here.
        args = build_parser().parse_args([*self._command[4:], *builtin.extra_args])
        # Compiled where the compiled forward runs (CPU); extra_args come after, so a --no-compile there wins.
        self._command.append("--compile" if builtin.compile and args.device == "cpu" else "--no-compile")
        self._command += builtin.extra_args
        self.model = args.served_model_name or served_model_name(engine_config(args))
        hidden = {*HIDDEN_ENV, *(u.api_key_env for u in config.upstreams if u.api_key_env)}
        self._env = {k: v for k, v in os.environ.items() if k not in hidden} | {SECRET_ENV: self.secret}
        self.process: asyncio.subprocess.Process | None = None
        self.exits = 0  # how often the engine process ended (each time restarted)
        self.refusal: str | None = None  # why the engine refused its model: it is not started again
        self._model_path = args.model
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._registry.allow_secret(self.secret)
        self._registry.expect([self.model])
        self._task = asyncio.create_task(self._run(), name=f"engine-supervisor-{self.url}")

    def pid_at(self, url: str | None) -> int | None:
        """The pid of the live engine process registered at ``url``, if it is ours."""
        process = self.process
        if url is None or process is None or process.returncode is not None:
            return None
        try:
            return process.pid if url_key(url) == url_key(self.url) else None
        except ValueError:  # some configured upstream's odd URL: not ours
            return None

    async def _run(self) -> None:
        backoff = self._builtin.restart_backoff_s
        while True:
            started = time.monotonic()
            returncode = await self._run_once()
            self.exits += 1
            for record in self._registry.remove_url(self.url):  # it cannot serve: no more routing there
                await record.engine.aclose()
            if returncode == EXIT_UNSUPPORTED_MODEL:  # no restart runs that model: say so once, and stop
                self.refusal = checkpoint_refusal(self._model_path) or (
                    f"the builtin engine cannot run the model {self._model_path} (its log says why)")
                log.error("%s; not restarting it", self.refusal)
                return
            if time.monotonic() - started >= self._builtin.restart_backoff_max_s:
                backoff = self._builtin.restart_backoff_s  # it had run stably: a fresh failure
            log.warning("the builtin engine exited (%s); restarting it in %.0fs", returncode, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._builtin.restart_backoff_max_s)

    async def _run_once(self) -> int | str:
        """Runs the engine process until it exits (and reaps it); its exit code, or why it did not start."""
        try:
            self.process = await asyncio.create_subprocess_exec(*self._command, env=self._env,
                                                                preexec_fn=_die_with_parent)
        except OSError as exc:
            return f"could not start: {exc}"
        log.info("builtin engine started (pid %d) at %s", self.process.pid, self.url)
        return await self.process.wait()

    async def aclose(self) -> None:
        """Stops supervising and the process: SIGTERM, then SIGKILL after the grace period."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # it may have just exited
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), self._builtin.stop_grace_s)
        except TimeoutError:
            process.kill()
            await process.wait()


class EngineSupervisors:
    """The ``[builtin] replicas`` engine processes (``parrot serve --engines N``), each supervised alone, on
    consecutive ports from ``[builtin] port``."""

    def __init__(self, config: GatewayConfig, registry: EngineRegistry):
        self.each = [EngineSupervisor(config, registry, replica) for replica in range(config.builtin.replicas)]

    def start(self) -> None:
        for supervisor in self.each:
            supervisor.start()

    @property
    def exits(self) -> int:
        return sum(supervisor.exits for supervisor in self.each)

    @property
    def refusals(self) -> list[str]:
        return sorted({supervisor.refusal for supervisor in self.each if supervisor.refusal})

    def pid_at(self, url: str | None) -> int | None:
        return next((pid for s in self.each if (pid := s.pid_at(url)) is not None), None)

    async def aclose(self) -> None:
        await asyncio.gather(*(supervisor.aclose() for supervisor in self.each))
