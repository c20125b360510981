"""Losing rank 0 while the ranks are inside ``init_process_group`` after a restart, and slow starts under load.

Rank 0 is the process that hosts the Wrapper's store when no launcher does, and it always hosts the
per-iteration store of the wrapped function's process group. Here it is SIGKILLed (only its process; its
monitor process lives on) inside ``init_process_group`` of the iteration after a restart, while one peer
waits there too and another has not arrived yet:

* without a launcher (rank 0 hosts the Wrapper's store) the job cannot continue (spec: "node failure on
  rank 0 causes termination of the entire job"): every rank must end, with one line naming the lost store,
  no hang, no process left behind;
* with the store hosted outside the ranks (as ``nvrx launch`` does: ``TORCHELASTIC_USE_AGENT_STORE``), the
  other ranks restart without rank 0 and finish.

And a rank that waits in ``init_process_group`` for a peer that is slow to arrive (a loaded machine) is not
restarted by the soft timeout nor killed by the hard timeout: the barrier timeout applies there.
"""

from __future__ import annotations

import json

import pytest

from tests.inprocess.harness import JobResult, run_job


WRAPPER = {"soft_timeout": 1.0, "hard_timeout": 6.0, "heartbeat_timeout": 4.0, "monitor_process_interval": 0.25,
           "termination_grace_time": 0.5, "barrier_timeout": 30.0, "completion_timeout": 30.0}

# Iteration 0: rank 1 raises (a restart). Iteration 1: rank 0 is SIGKILLed inside init_process_group once rank 1
# is in there too; rank 2 arrives only after the kill.
KILL_IN_INIT = {"wrapper": WRAPPER, "steps": 3, "gloo_timeout": 300,
                "actions": {"0": {"1": {"at_step": 1, "do": "raise"}}},
                "kill_in_init": {"rank": 0, "iteration": 1}}


def _assert_rank_0_died_inside_init(res: JobResult) -> None:
    assert res.codes[0] == -9, res.stderr[0][-2000:]
    killed = res.of(0, "killed_in_init", iteration=1)
    assert killed and killed[0]["inside"], "rank 0 was not inside init_process_group when it was killed"


@pytest.fixture(scope="module")
def rank_hosted(tmp_path_factory) -> JobResult:
    plan = dict(KILL_IN_INIT, late_init={"rank": 2, "iteration": 1, "after_kill": True})
    return run_job(tmp_path_factory.mktemp("rank_hosted"), 3, plan, timeout=120)


def test_without_a_launcher_losing_the_store_host_in_init_ends_every_rank(rank_hosted):
    res = rank_hosted
    _assert_rank_0_died_inside_init(res)
    for rank in (1, 2):
        assert res.codes[rank] != 0, f"rank {rank} went on without the store"
        assert not res.of(rank, "start", iteration=1), f"rank {rank} ran iteration 1 without the store"
    err = res.of(1, "wrapper_error")
    assert err and err[0]["kind"] == "StoreUnavailable", res.stderr[1][-2000:]
    assert "in-process restart store" in err[0]["message"] and "rank 0" in err[0]["message"]


def test_a_rank_stuck_connecting_to_the_dead_host_is_ended_by_its_hard_timeout(rank_hosted):
    # Rank 2 entered init_process_group after rank 0 died: torch retries the connection to rank 0's
    # process-group store (300 s here), deaf to the restart exception. Its monitor process must end it
    # although the store it would record that in is gone.
    res = rank_hosted
    assert res.of(2, "init_enter", iteration=1)
    assert res.codes[2] < 0, f"rank 2 was not ended by a signal: {res.codes[2]}\n{res.stderr[2][-2000:]}"
    assert "in-process restart store" in res.stderr[2] and "stopped answering" in res.stderr[2]


def test_without_a_launcher_nothing_is_left_running(rank_hosted):
    assert rank_hosted.leftovers == [], f"processes left behind: {rank_hosted.leftovers}"


@pytest.fixture(scope="module")
def agent_hosted(tmp_path_factory) -> JobResult:
    plan = dict(KILL_IN_INIT, late_init={"rank": 2, "iteration": 1, "after_kill": True, "then": "raise"})
    return run_job(tmp_path_factory.mktemp("agent_hosted"), 3, plan, timeout=120, agent_store=True)


def test_with_the_store_outside_the_ranks_the_others_restart_without_rank_0(agent_hosted):
    res = agent_hosted
    _assert_rank_0_died_inside_init(res)
    assert res.codes[1] == 0 and res.codes[2] == 0, (res.codes, res.stderr[1][-2000:], res.stderr[2][-2000:])
    for rank in (1, 2):
        assert len(res.pids(rank)) == 1, f"rank {rank} was restarted as a new process"
        assert sorted(res.starts(rank)) == [0, 2], f"rank {rank}: {sorted(res.starts(rank))}"
        assert res.starts(rank)[2]["world"] == 2
    assert sorted(res.starts(r)[2]["rank"] for r in (1, 2)) == [0, 1]
    assert "continuing without rank(s) 0 (the rank's process ended)" in res.stderr[1] + res.stderr[2]


def test_with_the_store_outside_the_ranks_nothing_is_left_running(agent_hosted):
    assert agent_hosted.leftovers == [], f"processes left behind: {agent_hosted.leftovers}"


# ---------------------------------------------------------------- slow starts are not hangs


def _late_peer(tmp_path, seconds: float, **wrapper):
    """Two ranks; rank 1 keeps busy SECONDS before it calls init_process_group, rank 0 waits there meanwhile (no
    Python bytecode runs on its main thread, as on a loaded machine while gloo connects). Both must end with 0."""
    plan = {"wrapper": dict(WRAPPER, **wrapper), "steps": 3, "gloo_timeout": 300,
            "late_init": {"rank": 1, "iteration": 0, "seconds": seconds}}
    res = run_job(tmp_path, 2, plan)
    assert res.codes == {0: 0, 1: 0}, res.stderr
    assert res.leftovers == []
    return res


def _iterations_started(res) -> list[list[int]]:
    return [sorted(res.starts(rank)) for rank in (0, 1)]


def test_waiting_in_init_process_group_for_a_late_peer_is_not_a_soft_timeout(tmp_path):
    res = _late_peer(tmp_path, 4)  # 4 soft timeouts
    assert "inside init_process_group (waiting for the other ranks to join)" in res.stderr[0]
    assert "soft timeout: no progress" not in res.stderr[0] + res.stderr[1]
    assert _iterations_started(res) == [[0], [0]], "a rank was restarted"


def test_nor_is_it_a_hard_timeout(tmp_path):
    # A hard timeout shorter than the wait: the monitor thread, which can run (so the GIL is free), tells the
    # monitor process that the main thread waits for its peers; without that, rank 0 would be killed.
    res = _late_peer(tmp_path, 5, hard_timeout=2.0)
    assert "inside init_process_group (waiting for the other ranks to join)" in res.stderr[0]
    assert _iterations_started(res) == [[0], [0]], "a rank was restarted"


def test_the_barrier_timeout_still_ends_a_wait_in_init_process_group(tmp_path):
    # The same late peer, but a barrier timeout shorter than its delay: the wait is a fault after all.
    res = _late_peer(tmp_path, 60, barrier_timeout=2.0, hard_timeout=30.0)
    assert "inside init_process_group (barrier_timeout=2 s)" in res.stderr[0]
    assert _iterations_started(res) == [[1], [1]]


# ---------------------------------------------------------------- the same under nvrx launch --inprocess

LAUNCHED = """
import datetime, json, os, signal, sys, threading, time
from pathlib import Path
import torch, torch.distributed as dist
from nvrx.launcher.rank import inprocess
OUT = Path(os.environ["TEST_OUT"])
it = inprocess.current().iteration
local = int(os.environ["LOCAL_RANK"])


def inside_init(thread_id):
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group":
            return True
        frame = frame.f_back
    return False


if it == 1 and local == 0:  # SIGKILLed inside init_process_group, once local rank 1 is in there too
    main = threading.get_ident()

    def kill():
        while not (inside_init(main) and (OUT / "init-it1-local1").exists()):
            time.sleep(0.01)
        time.sleep(0.2)
        print(json.dumps({"event": "killed", "inside": inside_init(main)}), flush=True)
        (OUT / "killed").touch()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
if it == 1 and local == 2:  # late: the others wait for it in init_process_group; it gives up once rank 0 is gone
    while not (OUT / "killed").exists():
        inprocess.current().ping()
        time.sleep(0.01)
    raise RuntimeError("gave up joining")
(OUT / f"init-it{it}-local{local}").touch()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
print(json.dumps({"event": "train", "pid": os.getpid(), "it": it, "rank": rank, "world": world, "local": local}),
      flush=True)
t = torch.ones(2)
for step in range(3):
    if it == 0 and rank == 1 and step == 1:
        raise RuntimeError("injected on rank 1")
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_under_nvrx_launch_losing_rank_0_in_init_after_a_restart_brings_in_the_spare(launcher, tmp_path):
    out = tmp_path / "marks"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    res = launcher.run("--nproc-per-node", "4", "--inprocess", "--inprocess-spares", "1", "--max-restarts", "0",
                       str(script), timeout=180, env={"TEST_OUT": str(out)})
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    killed = [line for line in lines if line["event"] == "killed"]
    assert killed and killed[0]["inside"], res.stdout + res.stderr
    assert res.returncode == 0, res.stderr[-3000:]
    trains = {it: sorted((t["rank"], t["local"], t["world"], t["pid"]) for t in lines
                         if t["event"] == "train" and t["it"] == it) for it in (0, 2)}
    assert [(r, loc, w) for r, loc, w, _ in trains[0]] == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]
    # local rank 0 is gone; 1 and 2 shift down, the spare (local 3) takes the last place, all in their own processes
    assert [(r, loc, w) for r, loc, w, _ in trains[2]] == [(0, 1, 3), (1, 2, 3), (2, 3, 3)]
    pids = {loc: pid for _, loc, _, pid in trains[0]}
    assert all(pids[loc] == pid for _, loc, _, pid in trains[2] if loc in pids), "a rank was restarted as a process"
    assert launcher.leftovers() == []
