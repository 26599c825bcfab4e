"""The order xdist hands test modules out in: longest first, by what each module took in the last run here.

`--dist loadfile` gives each worker a module at a time, in the collection's order; pytest-xdist's own reordering (by
number of tests, on unless `--no-loadscope-reorder`) put the one-test modules that take minutes (a compile, a 16k
prefill) last, so one worker ran them alone while the other idled. Longest first (the LPT rule) leaves the short
modules to even the workers out at the end. The seconds come from pytest's cache (.pytest_cache, per marker
expression, written by the controlling process at the end of a run without -k); where the cache has none (a fresh
clone, or CI's `-p no:cacheprovider`), from the committed MODULE_SECONDS file, which
`python -m tests.support.module_order` refreshes from this checkout's cache. A module timed in neither is placed by
its marks: those that load models or start processes before those that do not."""

from __future__ import annotations

import hashlib
import json
import resource
from collections import defaultdict
from pathlib import Path

import pytest

HEAVY_MARKS = ("model", "subprocess", "browser", "slow")
UNTIMED_HEAVY_S = 30.0  # a guess that places an untimed heavy module among the timed heavy ones
UNTIMED_TEST_S = 0.1
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")  # {cache key: {module: seconds}}


def cache_of(config: pytest.Config):
    """pytest's cache, or None: `-p no:cacheprovider` (as CI runs) leaves the config without the attribute."""
    return getattr(config, "cache", None)


def cache_key(config: pytest.Config) -> str:
    expression = config.option.markexpr or ""
    return "parrot/module_seconds/" + hashlib.sha1(expression.encode()).hexdigest()[:12]


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def committed_seconds() -> dict[str, dict[str, float]]:
    return json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}


def timed_seconds(config: pytest.Config) -> dict[str, float]:
    """Each module's seconds in the last run here of this marker expression, else in the committed file's."""
    cache = cache_of(config)
    kept = cache.get(cache_key(config), {}) if cache is not None else {}
    return kept or committed_seconds().get(cache_key(config), {})


def longest_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Sorts ``items`` in place: whole modules, longest first; the tests of a module keep their order."""
    timed = timed_seconds(config)
    guessed: dict[str, float] = defaultdict(float)
    for item in items:
        heavy = any(item.get_closest_marker(mark) for mark in HEAVY_MARKS)
        guessed[module_of(item.nodeid)] += UNTIMED_HEAVY_S if heavy else UNTIMED_TEST_S
    seconds = {module: timed.get(module, guess) for module, guess in guessed.items()}
    position = {module: index for index, module in enumerate(dict.fromkeys(module_of(i.nodeid) for i in items))}
    items.sort(key=lambda item: (-seconds[module_of(item.nodeid)], position[module_of(item.nodeid)]))


def cpu_seconds() -> float:
    """This process's CPU time and that of the children it has waited for (the engine and gateway processes a
    fixture started and stopped)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuMeter:
    """Registered in every process that runs tests: each report carries the CPU seconds its phase took, so that
    the suite's cost can be read per module (the suite is CPU-bound on two cores: wall seconds hide who pays).
    A child process its test dropped without waiting for is reaped later, by the next process subprocess starts
    (its cleanup of finished children), and counts there: a module of quick tests that start a process may show
    CPU that is not its own."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        started = getattr(item, "_parrot_cpu_mark", None)
        outcome = yield
        now = cpu_seconds()
        if started is not None:
            outcome.get_result().user_properties.append(("cpu_s", now - started))
        item._parrot_cpu_mark = now

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        item._parrot_cpu_mark = cpu_seconds()


class ModuleTimer:
    """Registered in the controlling process (or a run without xdist): sums each module's setup, call and
    teardown seconds from the reports and keeps them in the cache at the end of a run without -k; lists the
    modules that took the most CPU at the end of the run."""

    SHOWN = 12

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[module_of(report.nodeid)] += report.duration
        self.cpu[module_of(report.nodeid)] += sum(value for name, value in report.user_properties if name == "cpu_s")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.cpu or not any(self.cpu.values()):
            return
        terminalreporter.write_sep("-", f"CPU seconds (with their processes) of the {self.SHOWN} costliest modules")
        for module, cpu in sorted(self.cpu.items(), key=lambda kv: -kv[1])[:self.SHOWN]:
            terminalreporter.write_line(f"{cpu:8.1f} cpu s {self.seconds[module]:8.1f} s  {module}")
        terminalreporter.write_line(f"{sum(self.cpu.values()):8.1f} cpu s in all")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        cache = cache_of(config)
        if cache is None or config.option.keyword or not self.seconds:
            return
        kept = cache.get(cache_key(config), {})
        cache.set(cache_key(config), kept | {module: round(s, 2) for module, s in self.seconds.items()})


def save_committed(cache_dir: Path = Path(".pytest_cache")) -> None:
    """Copies this checkout's kept module seconds (every marker expression) into the committed file."""
    kept_dir = cache_dir / "v" / "parrot" / "module_seconds"
    seconds = {f"parrot/module_seconds/{path.name}": json.loads(path.read_text()) for path in sorted(kept_dir.iterdir())}
    MODULE_SECONDS.write_text(json.dumps(seconds, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    save_committed()
