"""NVRx's in-process restart API, used the way spec 000 and NVRx's examples use it.

The end-to-end test runs tests/compat/inprocess_example.py, a script in NVRx's style whose only change is
its import line, as three real ranks (gloo, a real TCPStore); the other tests pin the call shapes that
ported code depends on (argument names and order, defaults, return types, module names).
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import launcher.rank.inprocess as inprocess
from tests.conftest import REPO, free_port, tagged_processes, wait_for

EXAMPLE = Path(__file__).with_name("inprocess_example.py")


def _run_example(tmp_path: Path, world: int, plan: dict) -> tuple[dict[int, int], dict[int, list[dict]], str]:
    out = tmp_path / "out"
    out.mkdir()
    token = uuid.uuid4().hex
    port = free_port()
    procs = {}
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   NVRX_EXAMPLE_PLAN=json.dumps(plan), NVRX_EXAMPLE_OUT=str(out), NVRX_TEST_TOKEN=token,
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs[rank] = subprocess.Popen([sys.executable, str(EXAMPLE)], env=env, cwd=tmp_path,
                                       stdout=subprocess.DEVNULL, stderr=open(out / f"stderr{rank}", "w"))
    try:
        codes = {rank: proc.wait(timeout=120) for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    leftovers = not wait_for(lambda: not tagged_processes(token), timeout=10)
    stderr = "\n".join(f"--- rank {r}\n" + (out / f"stderr{r}").read_text()[-2500:] for r in procs)
    assert not leftovers, f"processes of the job outlived it: {tagged_processes(token)}\n{stderr}"
    events = {r: [json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()]
              if (out / f"rank{r}.jsonl").exists() else [] for r in procs}
    return codes, events, stderr


def _of(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


@pytest.mark.slow
def test_nvrx_style_script_with_a_spare_survives_a_dead_rank(tmp_path: Path) -> None:
    codes, events, stderr = _run_example(tmp_path, 3, {"exit_rank": 1, "exit_step": 2, "steps": 6})
    assert codes == {0: 0, 1: 17, 2: 0}, stderr
    # Tree(Layer(max_ranks=2, RESERVE)): ranks 0 and 1 active, rank 2 the spare that waits
    assert [(e["iteration"], e["rank"], e["world_size"]) for e in _of(events[0], "start")] == [(0, 0, 2), (1, 0, 2)]
    assert [(e["iteration"], e["rank"], e["world_size"]) for e in _of(events[2], "start")] == [(1, 1, 2)], stderr
    assert [e["iteration"] for e in _of(events[1], "start")] == [0]
    # the same process went on (in-process restart), with ThreadedFinalize run after the fault
    assert len({e["pid"] for e in _of(events[0], "start")}) == 1
    assert _of(events[0], "finalize") and _of(events[2], "finalize")
    # both survivors trained the same model (DDP) and got the wrapped function's return value back
    done = {r: _of(events[r], "done")[0] for r in (0, 2)}
    assert done[0]["weights"] == pytest.approx(done[2]["weights"]) and done[0]["iteration"] == 1
    assert _of(events[0], "returned")[0]["value"] == pytest.approx(done[0]["weights"])
    # completion ran on the ranks whose call succeeded; terminate on none of them
    assert [e["mode"] for r in (0, 2) for e in _of(events[r], "completion")] == ["ACTIVE", "ACTIVE"]
    assert not any(_of(events[r], "terminate") for r in (0, 2))


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
