"""The circuit breaker's states, on a clock the test moves."""

from __future__ import annotations

from gateway.circuit import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only():
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=Clock())

    breaker.failed()
    breaker.failed()
    breaker.succeeded()  # the count is of consecutive failures
    breaker.failed()
    breaker.failed()
    assert (breaker.state, breaker.allows()) == ("closed", True)

    breaker.failed()
    assert (breaker.state, breaker.allows()) == ("open", False)


def test_lets_exactly_one_probe_through_after_the_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.failed()

    clock.now += 9.9
    assert not breaker.allows()
    clock.now += 0.1
    assert (breaker.state, breaker.allows()) == ("half_open", True)
    breaker.attempt()  # the probe goes out
    assert not breaker.allows()  # and nothing else meanwhile

    breaker.failed()  # the probe failed: open for another cooldown
    assert (breaker.state, breaker.allows()) == ("open", False)
    clock.now += 10
    breaker.attempt()
    breaker.succeeded()  # the probe succeeded: closed
    assert (breaker.state, breaker.allows()) == ("closed", True)
    breaker.failed()  # the failure count started again
    assert breaker.state == "open"  # threshold 1


def test_a_probe_that_never_reports_frees_its_slot_after_a_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.failed()
    clock.now += 10
    breaker.attempt()  # its client went away: neither success nor failure is reported

    clock.now += 9
    assert not breaker.allows()
    clock.now += 1
    assert breaker.allows()


def test_trip_opens_at_once_and_restarts_the_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=5, cooldown_s=10, clock=clock)
    breaker.trip()  # a failed health check
    assert breaker.state == "open"
    clock.now += 8
    breaker.trip()
    clock.now += 8
    assert breaker.state == "open"
    clock.now += 2
    assert breaker.state == "half_open"
