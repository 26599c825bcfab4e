"""Modules go to the workers longest first: by the seconds the last run kept, else heavy-marked modules first."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.module_order import ModuleTimer, cache_key, longest_first


class Cache(dict):
    def get(self, key, default):
        return super().get(key, default)

    def set(self, key, value):
        self[key] = value


class Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return name if name in self.marks else None


def config(cache: Cache, markexpr: str = "", keyword: str = "") -> SimpleNamespace:
    return SimpleNamespace(cache=cache, option=SimpleNamespace(markexpr=markexpr, keyword=keyword))


def items(*spec: tuple[str, tuple[str, ...]]) -> list[Item]:
    return [Item(nodeid=nodeid, marks=marks) for nodeid, marks in spec]


def test_timed_modules_go_longest_first_and_keep_their_tests_order():
    run = config(Cache())
    run.cache.set(cache_key(run), {"a.py": 1.0, "b.py": 90.0, "c.py": 5.0})
    collected = items(("a.py::one", ()), ("b.py::one", ()), ("b.py::two", ()), ("c.py::one", ()), ("a.py::two", ()))
    longest_first(run, collected)
    assert [item.nodeid for item in collected] == ["b.py::one", "b.py::two", "c.py::one", "a.py::one", "a.py::two"]


def test_untimed_modules_that_start_processes_or_load_models_go_before_the_others():
    collected = items(*[(f"light.py::t{i}", ()) for i in range(50)], ("engine.py::t", ("subprocess",)))
    longest_first(config(Cache()), collected)
    assert collected[0].nodeid == "engine.py::t"


def test_the_timer_keeps_each_modules_seconds_per_marker_expression_and_not_for_a_k_run():
    cache = Cache()
    for run, kept in ((config(cache, keyword="one"), False), (config(cache, markexpr="not model"), True)):
        timer = ModuleTimer()
        for nodeid, seconds in (("a.py::one", 1.5), ("a.py::two", 2.0), ("b.py::one", 0.5)):
            timer.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds, user_properties=[]))
        timer.pytest_sessionfinish(SimpleNamespace(config=run))
        assert (cache.get(cache_key(run), None) == {"a.py": 3.5, "b.py": 0.5}) is kept
    assert cache_key(config(cache, markexpr="not model")) != cache_key(config(cache))



def test_a_run_without_the_cache_plugin_orders_by_marks_and_keeps_nothing():
    """`-p no:cacheprovider` (CI's run) leaves the config without a `cache` attribute at all."""
    run = SimpleNamespace(option=SimpleNamespace(markexpr="", keyword=""))
    collected = items(("light.py::t", ()), ("engine.py::t", ("subprocess",)))
    longest_first(run, collected)
    assert collected[0].nodeid == "engine.py::t"
    timer = ModuleTimer()
    timer.pytest_runtest_logreport(SimpleNamespace(nodeid="light.py::t", duration=1.0, user_properties=[]))
    timer.pytest_sessionfinish(SimpleNamespace(config=run))


def test_without_kept_seconds_the_committed_file_orders_the_modules(tmp_path, monkeypatch):
    from tests.support import module_order

    run = SimpleNamespace(option=SimpleNamespace(markexpr="", keyword=""))
    committed = tmp_path / "module_seconds.json"
    committed.write_text('{"%s": {"a.py": 2.0, "b.py": 40.0}}' % cache_key(run))
    monkeypatch.setattr(module_order, "MODULE_SECONDS", committed)
    collected = items(("a.py::t", ("subprocess",)), ("b.py::t", ()))
    longest_first(run, collected)
    assert [item.nodeid for item in collected] == ["b.py::t", "a.py::t"]


def test_the_committed_file_is_what_a_save_writes(tmp_path, monkeypatch):
    from tests.support import module_order

    kept = tmp_path / "v" / "parrot" / "module_seconds"
    kept.mkdir(parents=True)
    (kept / "abc").write_text('{"a.py": 1.5}')
    monkeypatch.setattr(module_order, "MODULE_SECONDS", tmp_path / "module_seconds.json")
    module_order.save_committed(tmp_path)
    assert module_order.committed_seconds() == {"parrot/module_seconds/abc": {"a.py": 1.5}}


def test_each_phase_reports_the_cpu_its_process_and_reaped_children_spent_and_modules_sum_it():
    """A child process run and waited for inside a test counts towards that test's module."""
    import subprocess
    import sys

    from tests.support.module_order import CpuMeter

    meter, item, phases = CpuMeter(), SimpleNamespace(), []

    class Outcome:
        def __init__(self):
            self.report = SimpleNamespace(user_properties=[])

        def get_result(self):
            return self.report

    meter.pytest_runtest_setup(item)
    for work in (lambda: None, lambda: subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)):
        work()
        wrapper, outcome = meter.pytest_runtest_makereport(item, None), Outcome()
        next(wrapper)
        try:
            wrapper.send(outcome)
        except StopIteration:
            pass
        phases.append(dict(outcome.report.user_properties)["cpu_s"])
    assert phases[1] > 0.05 and phases[1] > phases[0]

    timer = ModuleTimer()
    for cpu in phases:
        timer.pytest_runtest_logreport(SimpleNamespace(nodeid="a.py::t", duration=0.1, user_properties=[("cpu_s", cpu)]))
    assert timer.cpu["a.py"] == sum(phases)
