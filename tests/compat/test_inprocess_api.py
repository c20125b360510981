"""NVRx's in-process restart API, used the way spec 000 and NVRx's examples use it.

The end-to-end test runs tests/compat/inprocess_example.py, a script in NVRx's style whose only change is
its import line, as three real ranks (gloo, a real TCPStore); the other tests pin the call shapes that
ported code depends on (argument names and order, defaults, return types, module names).
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
from pathlib import Path

import pytest

import nvrx.launcher.rank.inprocess as inprocess
from tests.inprocess.harness import run_job

EXAMPLE = Path(__file__).with_name("inprocess_example.py")


def test_nvrx_style_script_with_a_spare_survives_a_dead_rank(tmp_path: Path) -> None:
    res = run_job(tmp_path, 3, {"exit_rank": 1, "exit_step": 2, "steps": 6}, timeout=120, script=EXAMPLE)
    assert res.codes == {0: 0, 1: 17, 2: 0}, res.stderr
    assert res.leftovers == []

    def starts(rank: int) -> list[tuple[int, int, int]]:
        return [(e["iteration"], e["rank"], e["world_size"]) for e in res.of(rank, "start")]

    # Tree(Layer(max_ranks=2, RESERVE)): ranks 0 and 1 active, rank 2 the spare that waits, then takes 1's place
    assert starts(0) == [(0, 0, 2), (1, 0, 2)] and starts(2) == [(1, 1, 2)], res.stderr
    assert [e["iteration"] for e in res.of(1, "start")] == [0]
    # the same process went on (in-process restart), with ThreadedFinalize run after the fault
    assert len({e["pid"] for e in res.of(0, "start")}) == 1
    assert res.of(0, "finalize") and res.of(2, "finalize")
    # both survivors trained the same model (DDP) and got the wrapped function's return value back
    done = {r: res.of(r, "done")[0] for r in (0, 2)}
    assert done[0]["weights"] == pytest.approx(done[2]["weights"]) and done[0]["iteration"] == 1
    assert res.of(0, "returned")[0]["value"] == pytest.approx(done[0]["weights"])
    # completion ran on the ranks whose call succeeded; terminate on none of them
    assert [e["mode"] for r in (0, 2) for e in res.of(r, "completion")] == ["ACTIVE", "ACTIVE"]
    assert not res.of(0, "terminate") and not res.of(2, "terminate")


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_state_fields_order_and_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f.name for f in dataclasses.fields(inprocess.State)]
    assert names[:2] == ["rank", "world_size"]
    assert {"active_rank", "active_world_size", "initial_rank", "initial_world_size", "iteration", "mode",
            "fn_exception"} <= set(names)
    state = inprocess.State(3, 8)
    assert (state.rank, state.world_size, state.initial_rank, state.mode) == (3, 8, 3, inprocess.Mode.INITIALIZED)
    frozen = state.freeze()
    assert isinstance(frozen, inprocess.FrozenState)
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.rank = 1
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert (inprocess.State.from_env().rank, inprocess.State.from_env().world_size) == (5, 6)
    monkeypatch.setenv("RANK", "five")
    with pytest.raises(ValueError, match="RANK"):
        inprocess.State.from_env()


def test_compose_takes_components_positionally_and_is_one_of_them() -> None:
    calls = []

    class A(inprocess.finalize.Finalize):
        def __call__(self, state):
            calls.append("a")
            return state

    class B(inprocess.finalize.Finalize):
        def __call__(self, state):
            calls.append("b")
            return state

    composed = inprocess.Compose(A(), B())
    assert isinstance(composed, inprocess.finalize.Finalize)  # NVRx: an instance of the components' base
    state = inprocess.State(0, 1).freeze()
    assert composed(state) is state and calls == ["b", "a"]  # the last one first, as function composition


def test_wrapper_and_component_signatures_ported_code_relies_on() -> None:
    wrapper = dict(_params(inprocess.Wrapper.__init__))
    for name in ("store_factory", "store_kwargs", "initialize", "abort", "finalize", "health_check",
                 "rank_assignment", "rank_filter", "monitor_thread_interval", "monitor_process_interval",
                 "heartbeat_interval", "progress_watchdog_interval", "soft_timeout", "hard_timeout",
                 "heartbeat_timeout", "barrier_timeout", "completion_timeout", "last_call_wait",
                 "termination_grace_time", "monitor_process_logfile", "monitor_process_pidfile", "enabled",
                 "completion", "terminate"):
        assert name in wrapper, name
    assert wrapper["enabled"] is True and wrapper["store_kwargs"] is None
    rl = inprocess.rank_assignment
    assert _params(rl.Tree.__init__) == [("layers", inspect.Parameter.empty), ("world_size_filter", None)]
    assert [n for n, _ in _params(rl.Layer.__init__)] == ["min_ranks", "max_ranks", "key_or_fn", "flag"]
    assert {f.name for f in rl.LayerFlag} == {"RESERVE", "BACKFILL"}
    assert issubclass(rl.RankDiscarded, inprocess.exception.RestartError)
    assert issubclass(inprocess.exception.RestartAbort, BaseException)
    check = inprocess.health_check.CudaHealthCheck(timeout=datetime.timedelta(seconds=3))
    assert check(inprocess.State(0, 1).freeze()) is not None  # no CUDA here: skipped, the state returned
    for module in ("nested_restarter", "completion", "terminate", "abort", "finalize", "initialize",
                   "rank_filter", "rank_assignment", "health_check", "exception", "store"):
        assert hasattr(inprocess, module), module
    assert callable(inprocess.CallWrapper.disable_hang_protection)
