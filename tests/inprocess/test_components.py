"""The Wrapper's components and argument checks, without starting ranks."""

from __future__ import annotations

import datetime
import logging
import threading

import psutil
import pytest

from nvrx.launcher.rank import inprocess
from nvrx.launcher.rank.inprocess import rank_assignment as ra
from nvrx.launcher.rank.inprocess import rank_filter as rf
from nvrx.launcher.rank.inprocess.call_wrapper import wants_call_wrapper
from nvrx.launcher.rank.inprocess.exceptions import HealthCheckError, RestartInterrupt, RetriesExhausted
from nvrx.launcher.rank.inprocess.state import State


def ctx(rank: int, world: int, gone=(), hosts=None) -> ra.RankAssignmentCtx:
    return ra.RankAssignmentCtx(State.initial(rank, world), None, set(gone), hosts or {})


# ---------------------------------------------------------------- rank assignment


def test_shift_ranks_closes_gaps_in_order():
    out = ra.ShiftRanks()(ctx(5, 6, gone={1, 4}))
    assert (out.state.rank, out.state.world_size, out.terminated_ranks) == (3, 4, set())
    with pytest.raises(ra.RankDiscarded, match="excluded by rank assignment"):
        ra.ShiftRanks()(ctx(1, 6, gone={1, 4}))


def test_spec_example_groups_of_eight_drop_together_then_shift():
    assignment = inprocess.Compose(
        inprocess.rank_assignment.ShiftRanks(),
        inprocess.rank_assignment.FilterGroupedByKey(key_or_fn=lambda rank, _: rank // 8, condition=lambda count: count == 8),
    )
    new = {r: assignment(ctx(r, 16, gone={9})).state for r in range(8)}
    assert all(s.world_size == 8 for s in new.values())
    assert [new[r].rank for r in range(8)] == list(range(8))
    for r in range(10, 16):
        with pytest.raises(ra.RankDiscarded):
            assignment(ctx(r, 16, gone={9}))


def test_rank_assignment_arguments_are_checked():
    with pytest.raises(ValueError, match="key_or_fn"):
        ra.FilterGroupedByKey(key_or_fn=42, condition=lambda n: True)
    with pytest.raises(ValueError, match="condition"):
        ra.FilterGroupedByKey(key_or_fn=lambda r, w: r, condition=None)
    with pytest.raises(ValueError, match="min_ranks"):
        ra.Layer(min_ranks=-1, key_or_fn="hostname")
    with pytest.raises(ValueError, match="Layer"):
        ra.Tree([])


# ---------------------------------------------------------------- rank filters and initializers


def test_spec_example_rank_filters_compose_to_largest_multiple_below_max():
    flt = inprocess.Compose(inprocess.rank_filter.WorldSizeDivisibleBy(4), inprocess.rank_filter.MaxActiveWorldSize(10))
    states = [flt(State.initial(r, 16)) for r in range(16)]
    assert {s.active_world_size for s in states} == {8}
    assert [s.active_rank for s in states] == list(range(8)) + [None] * 8
    with pytest.raises(ValueError):
        rf.MaxActiveWorldSize(0)
    with pytest.raises(ValueError):
        rf.WorldSizeDivisibleBy(True)


def test_retry_controller_limits_iterations_and_world_sizes():
    rc = inprocess.initialize.RetryController(max_iterations=3, min_world_size=2, min_active_world_size=2)
    assert rc(State.initial(0, 4).replace(iteration=2)).iteration == 2
    with pytest.raises(RetriesExhausted, match="max_iterations=3"):
        rc(State.initial(0, 4).replace(iteration=3))
    with pytest.raises(RetriesExhausted, match="min_world_size=2"):
        rc(State.initial(0, 1))
    with pytest.raises(RetriesExhausted, match="min_active_world_size=2"):
        rc(State.initial(0, 4).replace(active_world_size=1))
    assert not issubclass(RetriesExhausted, Exception)  # ends the Wrapper instead of restarting
    with pytest.raises(ValueError):
        inprocess.initialize.RetryController(max_iterations=0)


def test_fault_counter_counts_only_this_ranks_own_faults():
    fc = inprocess.health_check.FaultCounter(max_rank_faults=1)
    fc(State.initial(0, 2).replace(fn_exception=RestartInterrupt()))
    first = State.initial(0, 2).replace(fn_exception=ValueError("x"))
    fc(first)
    fc(first.replace(iteration=1))  # the same fault, seen again before the next run: counted once
    with pytest.raises(HealthCheckError, match="failed 2 times"):
        fc(State.initial(0, 2).replace(fn_exception=ValueError("y")))


def test_cuda_health_check_skips_on_a_cpu_only_machine(caplog, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(inprocess.health_check.CudaHealthCheck, "_skip_logged", False)
    check = inprocess.health_check.CudaHealthCheck()
    state = State.initial(1, 2)
    with caplog.at_level(logging.INFO, logger="nvrx.launcher.rank.inprocess.health_check"):
        logging.getLogger("nvrx.launcher.rank.inprocess").propagate = True
        try:
            assert check(state) is state
            assert check(state) is state
        finally:
            logging.getLogger("nvrx.launcher.rank.inprocess").propagate = False
    # one log record (counted by identity: a handler another test left on a logger in the chain would show it twice)
    skipped = {id(r) for r in caplog.records if "CudaHealthCheck skipped: no CUDA device" in r.getMessage()}
    assert len(skipped) == 1


def test_compose_runs_last_component_first_and_rejects_non_callables():
    order = []
    comp = inprocess.Compose(lambda x: order.append("f") or x + ["f"], lambda x: order.append("g") or x + ["g"])
    assert comp([]) == ["g", "f"] and order == ["g", "f"]
    with pytest.raises(ValueError, match="not callable"):
        inprocess.Compose("ShiftRanks")


def test_call_wrapper_is_passed_by_annotation_or_by_name():
    def by_annotation(cw: inprocess.CallWrapper): ...
    def by_string_annotation(cw: "inprocess.CallWrapper"): ...
    def by_name(call_wrapper=None): ...
    def neither(x=1): ...
    assert wants_call_wrapper(by_annotation) == "cw"
    assert wants_call_wrapper(by_string_annotation) == "cw"
    assert wants_call_wrapper(by_name) == "call_wrapper"
    assert wants_call_wrapper(neither) is None


# ---------------------------------------------------------------- bad input: ValueError before anything starts


def _snapshot() -> tuple[int, int]:
    return threading.active_count(), len(psutil.Process().children(recursive=True))


def _assert_refused_at_construction(kwargs, message):
    """Wrapper(**KWARGS) raises a ValueError containing MESSAGE and starts no thread or process."""
    before = _snapshot()
    with pytest.raises(ValueError) as err:
        inprocess.Wrapper(**kwargs)
    assert message in str(err.value)
    assert _snapshot() == before


@pytest.mark.parametrize("kwargs, message", [
    ({"soft_timeout": -1}, "soft_timeout must be > 0"),
    ({"hard_timeout": 10, "soft_timeout": 20}, "hard_timeout (10 s) must not be shorter than soft_timeout"),
    ({"barrier_timeout": "fast"}, "barrier_timeout must be a number"),
    ({"termination_grace_time": -0.5}, "termination_grace_time must be >= 0"),
    ({"last_call_wait": float("nan")}, "last_call_wait must be a number"),
    ({"heartbeat_timeout": 0.1, "monitor_process_interval": 0.5}, "heartbeat_timeout (0.1 s) must be longer"),
    ({"soft_timeout": 0.2, "progress_watchdog_interval": 0.5}, "soft_timeout (0.2 s) must be longer"),
    ({"abort": "destroy"}, "abort must be callable"),
    ({"health_check": 3}, "health_check must be callable"),
    ({"rank_filter": (rf.MaxActiveWorldSize(2), "x")}, "rank_filter: Compose: 'x' is not callable"),
    ({"rank_assignment": None}, "rank_assignment cannot be None"),
    ({"store_factory": dict}, "does not subclass"),
    ({"store_factory": type("LocalStore", (inprocess.store.FileStore,), {"__qualname__": "f.<locals>.LocalStore"})},
     "defined in a function"),
    ({"store_factory": type("MainStore", (inprocess.store.FileStore,), {"__module__": "__main__"})},
     "defined in the main script"),
    ({"store_kwargs": {"timeout": object()}}, "JSON-serialisable"),
    ({"monitor_process_logfile": "/tmp/m{node}.log"}, "only the {rank} placeholder"),
    ({"enabled": "yes"}, "enabled must be True or False"),
])
def test_bad_arguments_raise_value_error_at_construction(kwargs, message):
    _assert_refused_at_construction(kwargs, message)


def test_generators_and_async_functions_are_refused():
    wrapper = inprocess.Wrapper()

    def gen():
        yield 1

    async def coro():
        return 1

    async def agen():
        yield 1

    for fn, kind in ((gen, "a generator function"), (coro, "an async function"), (agen, "an async generator")):
        with pytest.raises(ValueError, match=kind):
            wrapper(fn)
    with pytest.raises(ValueError, match="can only wrap a function"):
        wrapper(42)


def test_missing_torchrun_environment_is_a_clear_error_before_anything_starts(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    wrapped = inprocess.Wrapper()(lambda: "ran")
    before = _snapshot()
    with pytest.raises(ValueError, match="RANK=''.*torchrun environment"):
        wrapped()
    assert _snapshot() == before


def test_disabled_wrapper_just_calls_the_function(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)

    @inprocess.Wrapper(enabled=False)
    def train(x, call_wrapper=None):
        """doc"""
        return x * 2

    assert train(21) == 42 and train.__doc__ == "doc" and train.__name__ == "train"


def test_spec_snippet_tuple_of_components_is_accepted():
    w = inprocess.Wrapper(rank_assignment=(inprocess.Compose(
        inprocess.rank_assignment.ShiftRanks(),
        inprocess.rank_assignment.FilterGroupedByKey(key_or_fn=lambda rank, _: rank // 8, condition=lambda count: count == 8),
    ),))
    assert w.rank_assignment(ctx(3, 16, gone={9})).state.rank == 3


# ---------------------------------------------------------------- component classes instead of instances


@pytest.mark.parametrize("kwargs, message", [
    ({"rank_assignment": ra.ShiftRanks}, "rank_assignment must be a component instance, not the class ShiftRanks; "
                                         "pass an instance: ShiftRanks()"),
    ({"rank_filter": rf.MaxActiveWorldSize}, "pass an instance: MaxActiveWorldSize()"),
    ({"abort": inprocess.abort.AbortTorchDistributed}, "pass an instance: AbortTorchDistributed()"),
    ({"health_check": inprocess.health_check.CudaHealthCheck}, "pass an instance: CudaHealthCheck()"),
    ({"initialize": inprocess.initialize.RetryController}, "pass an instance: RetryController()"),
    ({"rank_assignment": (ra.ShiftRanks(), ra.ShiftRanks)}, "rank_assignment: Compose: ShiftRanks is a class; "
                                                            "pass an instance: ShiftRanks()"),
])
def test_component_classes_are_refused_at_construction(kwargs, message):
    _assert_refused_at_construction(kwargs, message)


def test_compose_refuses_a_class_among_instances():
    with pytest.raises(ValueError, match=r"Compose: ShiftRanks is a class; pass an instance: ShiftRanks\(\)"):
        inprocess.Compose(ra.ShiftRanks, ra.FilterGroupedByKey(key_or_fn=lambda r, w: r // 2, condition=bool))
    with pytest.raises(ValueError, match=r"pass an instance: WorldSizeDivisibleBy\(\)"):
        inprocess.Compose(rf.MaxActiveWorldSize(4), rf.WorldSizeDivisibleBy)


# ---------------------------------------------------------------- durations: timedelta, bounds


def test_timedelta_durations_are_accepted_as_seconds():
    w = inprocess.Wrapper(soft_timeout=datetime.timedelta(seconds=30), hard_timeout=datetime.timedelta(minutes=1),
                          monitor_thread_interval=datetime.timedelta(milliseconds=50),
                          termination_grace_time=datetime.timedelta(0), last_call_wait=datetime.timedelta(0),
                          barrier_timeout=datetime.timedelta(minutes=5), completion_timeout=90)
    assert (w.soft_timeout, w.hard_timeout, w.monitor_thread_interval) == (30.0, 60.0, 0.05)
    assert (w.termination_grace_time, w.last_call_wait, w.barrier_timeout, w.completion_timeout) == (0, 0, 300, 90)
    assert all(isinstance(v, float) for v in (w.soft_timeout, w.hard_timeout, w.monitor_thread_interval))


@pytest.mark.parametrize("kwargs, message", [
    ({"soft_timeout": datetime.timedelta(seconds=-5)}, "soft_timeout must be > 0 seconds"),
    ({"hard_timeout": datetime.timedelta(seconds=10), "soft_timeout": datetime.timedelta(seconds=20)},
     "hard_timeout (10 s) must not be shorter than soft_timeout"),
    ({"monitor_thread_interval": 0}, "monitor_thread_interval must be > 0"),
    ({"monitor_thread_interval": float("inf")}, "monitor_thread_interval must be a number of seconds or a "
                                                 "datetime.timedelta"),
    ({"monitor_thread_interval": 1e-6}, "monitor_thread_interval must be at least 0.001 seconds"),
    ({"monitor_thread_interval": 7200}, "monitor_thread_interval must be at most 3600 seconds"),
    ({"monitor_process_interval": datetime.timedelta(hours=2)}, "monitor_process_interval must be at most 3600"),
    ({"progress_watchdog_interval": -1}, "progress_watchdog_interval must be > 0"),
    ({"last_call_wait": 1e5}, "last_call_wait must be at most 3600 seconds"),
    ({"barrier_timeout": 1e9}, "barrier_timeout must be at most 604800 seconds"),
    ({"hard_timeout": "90s"}, "hard_timeout must be a number of seconds or a datetime.timedelta, not '90s'"),
])
def test_bad_durations_raise_value_error_at_construction(kwargs, message):
    _assert_refused_at_construction(kwargs, message)
