"""monitors.inspection.timeline on event files written by the real writer (EventLog) with chosen times.

The files are written with the same event records (monitors.events) `nvrx launch` emits, so they look like
what the agents and monitors write.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nvrx.events import (
    AgentSignal, AgentStart, EventLog, FirstHeartbeat, ForkServerReady, FtConfig, FtConfigInfo, HangDetected, HangInfo,
    HeartbeatStats, JobEnd, MonitorConnect, MonitorDisconnect, MonitorSpawned, MonitorStart, RankExit, RankStart,
    RankTerminated, RdzvJoin, RdzvRound, RdzvStop, ResumeAttemptEnd, ResumeDecision, ResumeSubmit, SectionClose,
    SectionOpen, StopDetail, TimeoutsInfo,
)
from nvrx.inspection.event_files import NotARun, discover
from nvrx.inspection.run_report import build_report, make_report
from nvrx.inspection.timeline import Filters, Timeline
from nvrx.nvrx_cli.inspect_cmd import parse_since, render_text
from nvrx.nvrx_cli.inspect_text import report_dict

T = 1_700_000_000.0
TIMEOUTS = TimeoutsInfo(initial_heartbeat=600.0, heartbeat=300.0, sections={"step": 30.0}, out_of_section=None)
FT = FtConfigInfo(workload_check_interval=5.0, initial_rank_heartbeat_timeout=600.0, rank_heartbeat_timeout=300.0,
                  safety_factor=5.0, rank_termination_signal="SIGKILL", log_level="INFO",
                  rank_section_timeouts={"step": 30.0}, rank_out_of_section_timeout=None, auto_heartbeat=False)


class Node:
    """One node's agent file plus its rank monitors' files, written through EventLog."""

    def __init__(self, run_dir: Path, host: str, pid: int, nproc: int = 2, node_id: str | None = None) -> None:
        self.key = f"{host}-{pid}"
        self.node_id = node_id or f"{self.key}-abcdef"
        self.nproc = nproc
        self.agent = EventLog(run_dir / f"agent-{self.key}.jsonl", "agent")
        self.mons = [EventLog(run_dir / f"monitor-{self.key}-{lr}.jsonl", f"monitor-{lr}") for lr in range(nproc)]
        self.next_pid = pid * 10

    def start(self, t: float, run_id: str, max_restarts: int = 3, nnodes: str = "1:1") -> None:
        self.agent.emit(AgentStart(pid=1, nproc=self.nproc, nnodes=nnodes, max_restarts=max_restarts, run_id=run_id),
                        t=t)
        self.agent.emit(FtConfig(config=FT), t=t)
        for lr, m in enumerate(self.mons):
            self.agent.emit(MonitorSpawned(local_rank=lr, pid=500 + lr), t=t)
            m.emit(MonitorStart(rank=lr, pid=500 + lr, socket="/x", timeouts=TIMEOUTS, check_interval=5.0), t=t + 0.1)

    def round(self, t: float, r: int, nodes: list[str], restarts: int, group_rank: int = 0,
              run_at: float | None = None) -> list[int]:
        self.agent.emit(RdzvJoin(round=r, node_id=self.node_id), t=t)
        self.agent.emit(RdzvRound(round=r, group_rank=group_rank, nodes=nodes, world_size=self.nproc * len(nodes),
                                  restart_count=restarts, waited=0.01), t=t)
        pids = []
        for lr in range(self.nproc):
            self.next_pid += 1
            pids.append(self.next_pid)
            self.agent.emit(RankStart(local_rank=lr, rank=group_rank * self.nproc + lr, pid=self.next_pid,
                                      attempt=restarts, how="fork", seconds=0.004),
                            t=run_at if run_at is not None else t + 1.0)
        return pids

    def stop(self, t: float, r: int, kind: str, detail: StopDetail, restarts: int, give_up: bool = False) -> None:
        self.agent.emit(RdzvStop(round=r, kind=kind, by_node=self.node_id, detail=detail, restart_count=restarts,
                                 give_up=give_up), t=t)

    def end(self, t: float, status: str, code: int) -> None:
        self.agent.emit(JobEnd(status=status, exit_code=code, seconds=1.0, failures=[]), t=t)

    def steps(self, lr: int, pid: int, t0: float, t1: float, step_s: float, every: float = 10.0,
              ckpt_every: float | None = None) -> None:
        """A monitored run of local rank LR: step sections closed at the monitor's event rate; with CKPT_EVERY,
        a 'checkpointing' section closes that often (taking no step time)."""
        m = self.mons[lr]
        m.emit(MonitorConnect(rank=lr, pid=pid, generation=1, timeouts=TIMEOUTS), t=t0)
        m.emit(FirstHeartbeat(rank=lr, pid=pid, delay=0.5), t=t0 + 0.5)
        t, hb, next_ckpt = t0, 0, t0 + (ckpt_every or math.inf)
        while t + every <= t1:
            t += every
            n = int(every / step_s)
            hb += n
            m.emit(SectionOpen(rank=lr, section="step", open_for=0.1), t=t)
            m.emit(SectionClose(rank=lr, section="step", closes=n, last_duration=step_s, max_duration=step_s), t=t)
            m.emit(HeartbeatStats(rank=lr, count=hb, max_interval=step_s + 0.01, since_last=0.0), t=t)
            if t >= next_ckpt:
                m.emit(SectionClose(rank=lr, section="checkpointing", closes=1, last_duration=0.5, max_duration=0.5),
                       t=t)
                next_ckpt += ckpt_every or math.inf
        m.emit(MonitorDisconnect(rank=lr, pid=pid, generation=1, reason="rank_disconnected"), t=t1)

    def close(self) -> None:
        for log in (self.agent, *self.mons):
            log.close()


def _crash_run(run_dir: Path, signal: str | None = None, exitcode: int | None = 13) -> Node:
    """Round 0 (ranks up at T+2) ends when rank 1 dies at T+50; round 1 runs from T+53 to T+100."""
    n = Node(run_dir, "hostA", 7)
    n.start(T, "job1")
    pids = n.round(T + 1, 0, [n.node_id], 0, run_at=T + 2)
    n.agent.emit(RankExit(local_rank=1, rank=1, pid=pids[1], exitcode=exitcode, signal=signal, attempt=0,
                          abandoned=False), t=T + 50)
    n.stop(T + 50.5, 0, "failed", StopDetail(rank=1, local_rank=1, group_rank=0, pid=pids[1], exitcode=exitcode,
                                             signal=signal, abandoned=False, tail=["step 41: loss 0.5", "boom"],
                                             describe="x", round=0), 1)
    n.round(T + 52, 1, [n.node_id], 1, run_at=T + 53)
    n.stop(T + 100, 1, "succeeded", StopDetail(nodes=1), 1)
    n.end(T + 100, "succeeded", 0)
    n.close()
    return n


def test_crash_with_exit_code_cause_tail_and_time_lost(tmp_path):
    _crash_run(tmp_path / "job1")
    rep = build_report([tmp_path / "job1"])
    assert len(rep.jobs) == 1 and rep.jobs[0]["status"] == "succeeded" and len(rep.jobs[0]["rounds"]) == 2
    (f,) = rep.faults
    assert f["rank"] == 1 and f["kind"] == "failed"
    assert f["cause"] == "rank 1 exited with code 13"
    assert f["tail"] == ["step 41: loss 0.5", "boom"]
    assert f["t"] == T + 50                          # the failing rank's exit
    assert f["lost_s"] == pytest.approx(3.0)         # to all ranks of round 1 running (T+53)
    stop = [it for it in rep.timeline if it["kind"] == "failed"][0]
    assert stop["rank"] == 1 and "restart 1" in stop["text"]


def test_crash_by_signal(tmp_path):
    _crash_run(tmp_path / "job1", signal="SIGSEGV", exitcode=None)
    (f,) = build_report([tmp_path]).faults
    assert f["cause"] == "rank 1 crashed with SIGSEGV" and f["signal"] == "SIGSEGV"


def _hang_run(run_dir: Path, hang_in_detail: bool) -> None:
    n = Node(run_dir, "hostA", 7)
    n.start(T, "hang")
    pids = n.round(T + 1, 0, [n.node_id], 0, run_at=T + 2)
    hang = HangDetected(rank=1, global_rank=1, pid=pids[1], generation=1, reason="section_timeout", section="step",
                        elapsed=31.0, timeout=30.0, timeouts=TIMEOUTS, signal="SIGKILL")
    n.mons[1].emit(MonitorConnect(rank=1, pid=pids[1], generation=1, timeouts=TIMEOUTS), t=T + 2.5)
    n.mons[1].emit(hang, t=T + 60)
    n.mons[1].emit(RankTerminated(rank=1, pid=pids[1], signal="SIGKILL", reason="section_timeout"), t=T + 60)
    n.agent.emit(RankExit(local_rank=1, rank=1, pid=pids[1], exitcode=None, signal="SIGKILL", attempt=0,
                          abandoned=False), t=T + 60.1)
    # what the agent copies into its stop record: the monitor's event read back (MonitorGroup.hang_reason)
    detail_hang = HangInfo.of({**hang.to_fields(), "t": T + 60}) if hang_in_detail else None
    n.stop(T + 60.2, 0, "failed", StopDetail(rank=1, local_rank=1, group_rank=0, pid=pids[1], exitcode=None,
                                             signal="SIGKILL", abandoned=False, tail=["in step 7"], describe="x",
                                             round=0, hang=detail_hang), 1)
    n.round(T + 61, 1, [n.node_id], 1, run_at=T + 62)
    n.stop(T + 90, 1, "succeeded", StopDetail(nodes=1), 1)
    n.end(T + 90, "succeeded", 0)
    n.close()


def test_hang_cause_names_section_elapsed_and_timeout(tmp_path):
    _hang_run(tmp_path / "hang", hang_in_detail=True)
    rep = build_report([tmp_path])
    (f,) = rep.faults
    assert f["cause"] == ("rank 1 hung in section 'step' after 31.0 s, timeout 30 s "
                          "(killed with SIGKILL by its monitor)")
    assert f["hang"]["reason"] == "section_timeout"
    # the fault began at the last progress: detection time minus the elapsed time
    assert f["t"] == pytest.approx(T + 60 - 31.0)
    assert f["lost_s"] == pytest.approx(62 - 29.0)
    assert not [it for it in rep.timeline if it["kind"] == "hang_detected"]  # the stop explains it: one line


def test_the_stop_record_is_the_one_source_of_a_stops_hang_cause(tmp_path):
    # A stop record without the hang (an agent that could not read its monitor's file): the report does
    # not guess by matching pids; the monitor's hang shows as its own entry, the stop names the exit.
    _hang_run(tmp_path / "hang", hang_in_detail=False)
    rep = build_report([tmp_path])
    (f,) = rep.faults
    assert f["cause"] == "rank 1 was killed by SIGKILL (out of memory?)" and f["hang"] is None
    (item,) = [it for it in rep.timeline if it["kind"] == "hang_detected"]
    assert item["rank"] == 1 and "hung in section 'step' after 31.0 s" in item["text"]


def test_a_hang_on_another_node_with_the_same_pid_is_not_the_cause(tmp_path):
    # Two hosts share the log dir and their ranks happen to get the same pids: node B's monitor
    # reporting a hang of its pid P must not explain node A's rank P exiting with a code.
    run = tmp_path / "two"
    a, b = Node(run, "hostA", 7), Node(run, "hostB", 7)
    nodes = [a.node_id, b.node_id]
    a.start(T, "two", nnodes="2:2")
    b.start(T, "two", nnodes="2:2")
    pa = a.round(T + 1, 0, nodes, 0, group_rank=0, run_at=T + 2)
    pb = b.round(T + 1, 0, nodes, 0, group_rank=1, run_at=T + 2)
    assert pa == pb
    b.mons[1].emit(HangDetected(rank=1, global_rank=3, pid=pb[1], generation=1, reason="heartbeat_timeout",
                                elapsed=9.0, timeout=8.0, timeouts=TIMEOUTS, signal="SIGKILL"), t=T + 30)
    a.agent.emit(RankExit(local_rank=1, rank=1, pid=pa[1], exitcode=13, signal=None, attempt=0, abandoned=False),
                 t=T + 29.9)
    a.stop(T + 30, 0, "failed", StopDetail(rank=1, local_rank=1, group_rank=0, pid=pa[1], exitcode=13,
                                           abandoned=False, tail=[], describe="x", round=0), 0, give_up=True)
    a.end(T + 31, "failed", 1)
    b.end(T + 31, "failed", 1)
    a.close()
    b.close()
    (f,) = build_report([run]).faults
    assert f["cause"] == "rank 1 exited with code 13 on node hostA"  # one name per node: its host
    assert f["hang"] is None
    (item,) = [it for it in build_report([run]).timeline if it["kind"] == "hang_detected"]
    assert item["rank"] == 3  # node B's hang is shown as its own, with B's rank


def test_an_agent_error_after_the_store_host_died_is_in_the_report(tmp_path):
    run = tmp_path / "lost"
    a, b = Node(run, "hostA", 7, nproc=1), Node(run, "hostB", 8, nproc=1)
    nodes = [a.node_id, b.node_id]
    a.start(T, "lost", nnodes="1:2")
    b.start(T, "lost", nnodes="1:2")
    a.round(T + 1, 0, nodes, 0, group_rank=0)
    b.round(T + 1, 0, nodes, 0, group_rank=1)
    a.close()  # killed: no job_end
    why = "lost the rendezvous store at 127.0.0.1:29500 (Connection reset by peer); its host agent is gone"
    b.agent.emit(JobEnd(status="failed", exit_code=1, detail=why, seconds=19.0, failures=[]), t=T + 20)
    b.close()
    (item,) = [i for i in build_report([run]).timeline if i["kind"] in ("job_end", "job_open")]
    assert f"node hostB: {why}" in item["text"]  # one name per node: its host


def test_node_left_counts_from_the_lost_nodes_last_event(tmp_path):
    run = tmp_path / "two"
    a, b = Node(run, "hostA", 7, nproc=1), Node(run, "hostB", 8, nproc=1)
    nodes = [a.node_id, b.node_id]
    a.start(T, "two", nnodes="1:2")
    b.start(T + 0.2, "two", nnodes="1:2")
    a.round(T + 1, 0, nodes, 0, group_rank=0, run_at=T + 2)
    b.round(T + 1, 0, nodes, 0, group_rank=1, run_at=T + 2.5)
    b.agent.emit(ForkServerReady(seconds=1.0, pid=9, import_seconds=1.0, threads=1), t=T + 20)  # its last sign of life
    b.close()
    a.stop(T + 35, 0, "node_left", StopDetail(node=b.node_id, group_rank=1), 1)
    a.round(T + 40, 1, [a.node_id], 1, run_at=T + 41)
    a.stop(T + 60, 1, "succeeded", StopDetail(nodes=1), 1)
    a.end(T + 60, "succeeded", 0)
    a.close()
    rep = build_report([run])
    (f,) = rep.faults
    assert f["kind"] == "node_left" and f["node"] == "hostB"
    assert f["cause"].startswith("node hostB left")
    assert f["t"] == T + 20 and f["lost_s"] == pytest.approx(21.0)
    assert rep.jobs[0]["status"] == "succeeded"  # the node that left writes no job_end: not "still running"
    assert rep.jobs[0]["rounds"][0]["ranks_running_at"] == T + 2.5  # all ranks of both nodes


def test_interrupted_job_and_resume_chain(tmp_path):
    a = Node(tmp_path / "1001", "hostA", 7)
    a.start(T, "1001")
    a.round(T + 1, 0, [a.node_id], 0, run_at=T + 2)
    a.agent.emit(AgentSignal(signal="SIGTERM", phase="running", round=0), t=T + 30)
    a.stop(T + 30, 0, "interrupted", StopDetail(signal="SIGTERM", signum=15), 0)
    a.end(T + 31, "failed", 143)
    a.close()
    resume = EventLog(tmp_path / "state" / "resume.jsonl", "resume")
    resume.emit(ResumeAttemptEnd(attempt=1, exit_code=143, cause="interrupted", finished=False), t=T + 32)
    resume.emit(ResumeDecision(action="continue", reason="interrupted by SIGTERM", attempts=1, failures=0), t=T + 32.5)
    resume.emit(ResumeSubmit(status="submitted", method="sbatch", from_job="1001", command=["sbatch"], exclude=[],
                             job_id="1002"), t=T + 33)
    resume.close()
    with open(tmp_path / "state" / "resume.jsonl", "a") as fh:  # a newer writer's event
        fh.write(json.dumps({"v": 1, "t": T + 34, "src": "resume", "ev": "resume_something_new", "x": 1}) + "\n")
    b = Node(tmp_path / "1002", "hostB", 9)
    b.start(T + 100, "1002")
    b.round(T + 101, 0, [b.node_id], 0, run_at=T + 104)
    b.stop(T + 200, 0, "succeeded", StopDetail(nodes=1), 0)
    b.end(T + 200, "succeeded", 0)
    b.close()
    rep = build_report([tmp_path])
    assert [j["run_id"] for j in rep.jobs] == ["1001", "1002"]
    assert rep.jobs[0]["status"] == "interrupted" and rep.jobs[0]["exit_code"] == 143
    assert rep.jobs[0]["exit_meaning"] == "stopped on SIGTERM, resumable"
    (f,) = rep.faults
    assert f["kind"] == "interrupted" and "SIGTERM" in f["cause"]
    assert f["lost_s"] == pytest.approx(74.0)      # to the next job's ranks running
    (decision,) = [it for it in rep.items if it.kind == "resume:resume_decision"]
    assert decision.text is None and decision.form == "resume_decision" and decision.level == "info"  # data
    assert decision.fields == {"action": "continue", "reason": "interrupted by SIGTERM", "attempts": 1, "failures": 0}
    texts = [it["text"] for it in report_dict(rep)["timeline"]]  # the --json report: worded by the renderer
    assert "resume decision: continue: interrupted by SIGTERM (attempts 1, failures 0)" in texts
    assert "resume: resume something new (x=1)" in texts
    assert rep.unknown_events == {"resume/resume_something_new": 1}  # shown, counted, not fatal
    assert rep.span["wall_s"] == pytest.approx(200.0)
    ts = [it["t"] for it in rep.timeline]
    assert ts == sorted(ts)


def _steps_run(run_dir: Path, ckpt_every: float | None) -> None:
    """Round 0: ranks up at T+10, 60 s of steps, fails at T+70; round 1: up at T+90, 20 s of steps, succeeds."""
    n = Node(run_dir, "hostA", 7)
    n.start(T, "g")
    pids = n.round(T, 0, [n.node_id], 0, run_at=T + 10)
    for lr in range(2):  # 6 batches x 20 closes x 0.5 s = 60 s in `step`; checkpoints at T+50 (with ckpt_every=40)
        n.steps(lr, pids[lr], T + 10, T + 70, step_s=0.5, ckpt_every=ckpt_every)
    n.stop(T + 70, 0, "failed", StopDetail(rank=0, pid=pids[0], exitcode=1, tail=[], group_rank=0), 1)
    pids = n.round(T + 80, 1, [n.node_id], 1, run_at=T + 90)
    for lr in range(2):
        n.steps(lr, pids[lr], T + 90, T + 110, step_s=0.25, ckpt_every=ckpt_every)  # 2 x 40 x 0.25 s = 20 s
    n.stop(T + 110, 1, "succeeded", StopDetail(nodes=1), 1)
    n.end(T + 110, "succeeded", 0)
    n.close()


def test_goodput_from_step_sections_leaves_out_work_redone_after_a_restart(tmp_path):
    _steps_run(tmp_path / "g", ckpt_every=40)
    rep = build_report([tmp_path])
    a = rep.time_accounting
    assert a["wall_s"] == pytest.approx(110.0)
    assert a["uptime_s"] == pytest.approx(60.0 + 20.0)     # all ranks running: T+10..T+70, T+90..T+110
    assert rep.uptime == pytest.approx(80.0 / a["wall_s"], abs=1e-3)
    assert rep.goodput_source == "'step' sections"
    assert a["progress_s"] == pytest.approx(80.0)
    assert a["recomputed_s"] == pytest.approx(20.0)       # round 0's steps after its last checkpoint (T+50)
    assert a["kept_s"] == pytest.approx(60.0)
    assert rep.goodput == pytest.approx(60.0 / a["wall_s"], abs=1e-3) and rep.goodput < rep.uptime
    r0 = rep.ranks[0]
    assert r0["rank"] == 0 and r0["sessions"] == 2 and r0["heartbeats"] == 120 + 80 and not r0["auto_heartbeat"]
    assert r0["sections"]["step"]["closes"] == 200 and r0["sections"]["step"]["max_s"] == 0.5
    text = render_text(rep)
    assert "uptime 72.7 %: 80.00 s with all ranks running / 110.00 s wall" in text
    assert "goodput 54.5 % (from 'step' sections): 60.00 s of progress kept / 110.00 s wall" in text
    assert "20.00 s of progress redone after restarts" in text
    d = rep.to_dict()
    assert (d["uptime"], d["goodput"], d["goodput_source"]) == (rep.uptime, rep.goodput, "'step' sections")


def test_goodput_from_heartbeats_when_there_is_no_step_section(tmp_path):
    _steps_run(tmp_path / "g", ckpt_every=40)
    rep = build_report([tmp_path], Filters(step_section="nope"))
    a = rep.time_accounting
    assert rep.goodput_source == "heartbeats"
    # first heartbeat (connect + 0.5 s) to the last one: 59.5 s + 19.5 s; round 0 keeps T+10.5..T+50
    assert a["progress_s"] == pytest.approx(79.0) and a["kept_s"] == pytest.approx(39.5 + 19.5)
    assert rep.goodput < rep.uptime


def test_without_checkpoint_sections_recompute_is_unknown_and_said_so(tmp_path):
    _steps_run(tmp_path / "g", ckpt_every=None)
    rep = build_report([tmp_path])
    a = rep.time_accounting
    assert a["recomputed_s"] is None and a["kept_s"] == pytest.approx(80.0)
    assert "unknown: no complete checkpoints reported and no 'checkpointing' sections" in a["recompute"]
    assert "recompute unknown: no complete checkpoints reported" in render_text(rep)


def test_no_progress_source_means_no_goodput(tmp_path):
    _crash_run(tmp_path / "job1")  # monitors started, but no rank ever beat or opened a section
    rep = build_report([tmp_path])
    assert rep.uptime is not None and rep.goodput is None and rep.goodput_source is None
    text = render_text(rep)
    assert "no goodput (no progress source" in text and "goodput 0" not in text


def test_automatic_heartbeats_are_a_progress_source_and_shown_as_auto(tmp_path):
    n = Node(tmp_path / "a", "hostA", 7, nproc=1)
    n.start(T, "auto")
    (pid,) = n.round(T, 0, [n.node_id], 0, run_at=T + 1)
    m = n.mons[0]
    m.emit(MonitorConnect(rank=0, pid=pid, generation=1, timeouts=TIMEOUTS), t=T + 1)
    for t in (T + 31, T + 61):  # the rank's interpreter kept running bytecode until T+60
        m.emit(HeartbeatStats(rank=0, count=0, max_interval=0.0, auto_since_last=1.0), t=t)
    m.emit(MonitorDisconnect(rank=0, pid=pid, generation=1, reason="rank_disconnected"), t=T + 61)
    n.stop(T + 61, 0, "succeeded", StopDetail(nodes=1), 0)
    n.end(T + 61, "succeeded", 0)
    n.close()
    rep = build_report([tmp_path])
    assert rep.goodput_source == "automatic heartbeats"
    assert rep.time_accounting["progress_s"] == pytest.approx(59.0)  # session start (T+1) to the last beat (T+60)
    (r0,) = rep.ranks
    assert r0["heartbeats"] == 0 and r0["auto_heartbeat"]
    assert "  0     hostA  1     auto " in render_text(rep)


def test_rank_and_since_filters(tmp_path):
    _hang_run(tmp_path / "hang", True)
    assert build_report([tmp_path], Filters(rank=0)).faults == []
    assert [f["rank"] for f in build_report([tmp_path], Filters(rank=1)).faults] == [1]
    late = build_report([tmp_path], Filters(since=T + 61))
    assert late.faults == [] and all(it["t"] >= T + 61 for it in late.timeline)
    assert [it["kind"] for it in late.timeline] == ["round", "job_end"]


def test_corrupt_lines_are_counted_and_skipped(tmp_path):
    run = tmp_path / "job1"
    _crash_run(run)
    agent = next(run.glob("agent-*.jsonl"))
    lines = agent.read_bytes().splitlines(keepends=True)
    bad = [b'{"v":1,"t":17000', b"\x00" * 32, b"not json at all", b"[1,2,3]", b'{"v":1,"src":"agent","ev":"x"}',
           b'{"v":1,"t":1700000001.0,"src":"agent","ev":"rdzv_round","round":"zero"}', b"\xff\xfe\xfd"]
    agent.write_bytes(b"".join(lines[:3]) + b"\n".join(bad) + b"\n" + b"".join(lines[3:]) + b'{"v":1,"t":17')
    mon = next(run.glob("monitor-*-0.jsonl"))
    with open(mon, "ab") as fh:
        fh.write(b'{"v":1,"t":1700000009.0,"src":"monitor-0","ev":"heartbeat_stats","rank":0,"cou\n')
    rep = build_report([run])
    assert rep.corrupt["count"] == len(bad) + 2
    assert len(rep.corrupt["first"]) == 5 and "truncated line" in rep.corrupt["first"][0]
    assert any("NUL" in x for x in rep.corrupt["first"])
    (f,) = rep.faults  # the rest of the run is still read
    assert f["cause"] == "rank 1 exited with code 13"
    text = render_text(rep)
    assert f"Corrupt lines: {len(bad) + 2} skipped" in text and "\x1b[" not in text


def test_deferred_parsing_gives_the_same_report_as_parsing_everything(tmp_path):
    """The fast path (heartbeat_stats/section_open parsed lazily) must not change any number."""
    n = Node(tmp_path / "g", "hostA", 7)
    n.start(T, "g")
    pids = n.round(T, 0, [n.node_id], 0, run_at=T + 1)
    n.steps(0, pids[0], T + 1, T + 200, step_s=0.3)
    n.mons[1].emit(MonitorConnect(rank=1, pid=pids[1], generation=1, timeouts=TIMEOUTS), t=T + 1)
    n.mons[1].emit(SectionOpen(rank=1, section="checkpointing", open_for=4.0), t=T + 5)  # still open at the end
    n.mons[1].emit(HeartbeatStats(rank=1, count=7, max_interval=2.0, since_last=0.0), t=T + 6)
    n.close()
    fast = build_report([tmp_path]).to_dict()
    slow = build_report([tmp_path], Filters(since=T - 1)).to_dict()  # --since disables the fast path
    fast["filters"] = slow["filters"] = None
    assert json.dumps(fast, sort_keys=True) == json.dumps(slow, sort_keys=True)
    r1 = [r for r in fast["ranks"] if r["rank"] == 1][0]
    assert r1["heartbeats"] == 7 and r1["open_sections"] == {"checkpointing": 4.0}


def test_follow_reads_appended_lines_and_waits_for_a_partial_one(tmp_path):
    run = tmp_path / "live"
    n = Node(run, "hostA", 7)
    n.start(T, "live")
    n.round(T + 1, 0, [n.node_id], 0)
    tl = Timeline()
    tl.live = True
    tl.add_files(discover([run]))
    for ef in tl.files:
        tl.consume(ef, final=False)
    assert [it.kind for it in make_report(tl, now=T + 5).items] == ["job_start", "round", "job_open"]
    agent = next(f for f in tl.files if f.kind == "agent")
    line = json.dumps({"v": 1, "t": T + 9, "src": "agent", "ev": "rdzv_stop", "round": 0, "kind": "failed",
                       "by_node": n.node_id, "detail": {"rank": 0, "exitcode": 2, "tail": []},
                       "restart_count": 1, "give_up": True}).encode()
    with open(agent.path, "ab") as fh:
        fh.write(line[:30])           # a writer mid-line: not corrupt, just not there yet
    tl.consume(agent, final=False)
    assert tl.damage.count == 0 and make_report(tl, now=T + 9).faults == []
    with open(agent.path, "ab") as fh:
        fh.write(line[30:] + b"\n")
    tl.consume(agent, final=False)
    (f,) = make_report(tl, now=T + 9).faults
    assert f["cause"] == "rank 0 exited with code 2" and f["give_up"] and tl.damage.count == 0
    n.close()


def test_jobs_in_one_run_dir_are_told_apart_by_time(tmp_path):
    """`nvrx resume` inside one allocation relaunches with the same run id: same dir, two jobs."""
    run = tmp_path / "same"
    for i, t0 in enumerate((T, T + 100)):
        n = Node(run, "hostA", 7 + i)
        n.start(t0, "same")
        n.round(t0 + 1, 0, [n.node_id], 0)
        if i == 0:  # killed by the time limit: no stop, no job_end
            n.close()
            continue
        n.stop(t0 + 50, 0, "succeeded", StopDetail(nodes=1), 0)
        n.end(t0 + 50, "succeeded", 0)
        n.close()
    rep = build_report([run])
    assert [j["status"] for j in rep.jobs] == ["no end record (agent killed, or still running)", "succeeded"]


def test_bad_paths_raise_one_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    (tmp_path / "other" / "data.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(NotARun, match="empty directory"):
        discover([tmp_path / "empty"])
    with pytest.raises(NotARun, match="no nvrx event files"):
        discover([tmp_path / "other"])
    with pytest.raises(NotARun, match="no such file"):
        discover([tmp_path / "missing"])
    with pytest.raises(NotARun, match="not an nvrx event file"):
        discover([tmp_path / "other" / "notes.txt"])


def test_parse_since():
    now = 1_000_000.0
    assert parse_since("10m", now) == now - 600
    assert parse_since("1h30m", now) == now - 5400
    assert parse_since("90s", now) == now - 90
    assert parse_since("2d", now) == now - 2 * 86400
    assert parse_since("2024-05-01T12:30:00+00:00", now) == 1714566600.0
    import click

    with pytest.raises(click.BadParameter, match="ISO time"):
        parse_since("yesterday-ish", now)


def test_steering_exit_code_ends_the_job_without_restart(tmp_path):
    n = Node(tmp_path / "s", "hostA", 7)
    n.start(T, "s")
    pids = n.round(T + 1, 0, [n.node_id], 0)
    n.stop(T + 9, 0, "failed", StopDetail(rank=0, local_rank=0, group_rank=0, pid=pids[0], exitcode=16, tail=[],
                                          no_restart=True, steer=16), 1, give_up=True)
    n.end(T + 10, "failed", 16)
    n.close()
    rep = build_report([tmp_path])
    (f,) = rep.faults
    assert f["cause"] == "rank 0 exited with code 16 (resume on different hardware)"
    assert "no restart in place" in f["text"] and f["lost_s"] is None
    assert rep.jobs[0]["status"] == "stopped: rank 0's exit code 16 (resume on different hardware)"
    assert rep.jobs[0]["exit_code"] == 16
