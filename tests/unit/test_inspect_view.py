"""`nvrx inspect`'s view of many nodes and of job outcomes: one name per node, folded health checks, outcome words
that match what happened, every --json entry tied to its job, --node, and --follow rewriting --html.

Event files are written with the real writer (EventLog) as the agents and monitors write them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from nvrx.events import (AgentStart, EventLog, HealthCheckInfo, JobEnd, MonitorConnect, MonitorDisconnect, NodeHealth,
                         RankStart, RdzvJoin, RdzvRound, RdzvStop, ResumeAttemptEnd, ResumeAttemptStart,
                         ResumeDecision, SectionClose, StopDetail, TimeoutsInfo)
from tests.conftest import REPO, wait_for

ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
T = 1_700_000_000.0
OK_CHECKS = [HealthCheckInfo(name="memory", status="ok", detail="enough", seconds=0.001)]


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvrx", "inspect", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


class Cluster:
    """N agents (one host each) and one rank monitor per node, logging rounds the way the real ones do."""

    def __init__(self, run: Path, n: int, run_id: str = "big", t0: float = T) -> None:
        self.hosts = [f"gpu{i:03d}" for i in range(n)]
        self.ids = [f"{h}-{900 + i}-{i:06x}" for i, h in enumerate(self.hosts)]
        self.agents = [EventLog(run / f"agent-{h}-{900 + i}.jsonl", "agent") for i, h in enumerate(self.hosts)]
        self.mons = [EventLog(run / f"monitor-{h}-{900 + i}-0.jsonl", "monitor-0") for i, h in enumerate(self.hosts)]
        for i, a in enumerate(self.agents):
            a.emit(AgentStart(pid=900 + i, nproc=1, nnodes=f"1:{n}", max_restarts=5, run_id=run_id), t=t0)

    def round(self, r: int, t: float, members: list[int], stop: str, detail: StopDetail, length: float = 50.0,
              sick: tuple[int, ...] = ()) -> None:
        for i in members + list(sick):
            ok = i not in sick
            checks = OK_CHECKS if ok else [HealthCheckInfo(name="disk", status="failed", detail="disk full",
                                                           seconds=0.002)]
            self.agents[i].emit(NodeHealth(ok=ok, seconds=0.003 + 0.001 * (i % 7), checks=checks,
                                           action="joins" if ok else "sits out"), t=t - 1)
        nodes = [self.ids[i] for i in members]
        for g, i in enumerate(members):
            a = self.agents[i]
            a.emit(RdzvJoin(round=r, node_id=self.ids[i]), t=t)
            a.emit(RdzvRound(round=r, group_rank=g, nodes=nodes, world_size=len(nodes), restart_count=r, waited=0.1),
                   t=t)
            pid = 10_000 * (r + 1) + i
            a.emit(RankStart(local_rank=0, rank=g, pid=pid, attempt=r, how="fork", seconds=0.01), t=t + 1)
            self.mons[i].emit(MonitorConnect(rank=0, global_rank=g, pid=pid, generation=r + 1,
                                             timeouts=TimeoutsInfo(heartbeat=60.0)), t=t + 1.5)
            self.mons[i].emit(SectionClose(rank=0, section="step", closes=40, last_duration=1.0, max_duration=1.0),
                              t=t + length - 5)
            self.mons[i].emit(MonitorDisconnect(rank=0, pid=pid, generation=r + 1, reason="rank_exited"),
                              t=t + length)
            a.emit(RdzvStop(round=r, kind=stop, by_node=nodes[0], detail=detail, restart_count=r + 1,
                            give_up=False), t=t + length)

    def end(self, t: float, codes: dict[int, int], sat_out: tuple[int, ...] = ()) -> None:
        for i, a in enumerate(self.agents):
            code = codes.get(i, 0)
            status = "succeeded" if code == 0 else "steered" if code == 16 else "failed"
            a.emit(JobEnd(status=status, exit_code=code, seconds=t - T,
                          detail="node health check failed" if i in sat_out else None), t=t)
        for log in self.agents + self.mons:
            log.close()


def test_a_node_that_sat_out_while_the_others_finished_does_not_stop_the_job(tmp_path):
    run = tmp_path / "sat"
    c = Cluster(run, 3)
    c.round(0, T + 5, [0, 1, 2], "failed", StopDetail(rank=1, local_rank=0, group_rank=1, pid=10_001, exitcode=1,
                                                           tail=["boom"]))
    c.round(1, T + 70, [0, 1], "succeeded", StopDetail(nodes=2), sick=(2,))  # gpu002 fails its checks, sits out
    c.end(T + 130, {2: 16}, sat_out=(2,))
    rep = json.loads(inspect("--json", str(run)).stdout)
    (job,) = rep["jobs"]
    assert job["status"] == "succeeded; node gpu002 sat out (failed its health checks, exit 16)"
    assert job["exit_code"] == 0 and "stopped" not in job["status"]
    text = inspect(str(run)).stdout
    assert "job big succeeded; node gpu002 sat out (failed its health checks, exit 16) (exit code 0" in text
    assert "node gpu002 failed its health checks" in text and "disk failed: disk full" in text
    # one name per node, before and after it joined: never its rendezvous id
    assert "gpu001-901" not in text and "000001" not in text and "on node gpu001" in text
    assert [rd["nodes"] for rd in job["rounds"]] == [["gpu000", "gpu001", "gpu002"], ["gpu000", "gpu001"]]


def test_two_hundred_nodes_fold_into_a_screen_and_node_filters_show_the_rest(tmp_path):
    run = tmp_path / "big"
    n = 200
    c = Cluster(run, n)
    for r in range(4):
        c.round(r, T + 5 + 60 * r, list(range(n)), "failed" if r < 3 else "succeeded",
                StopDetail(rank=7 * r, local_rank=0, group_rank=7 * r, pid=10_000 * (r + 1) + 7 * r, exitcode=1,
                           tail=["x"]) if r < 3 else StopDetail(nodes=n))
    c.end(T + 300, {})
    res = inspect("--tail", "1", str(run))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) < 70, res.stdout
    health = [ln for ln in lines if "health checks" in ln]  # on round 0's line; rounds 1-3 start like it
    assert len(health) == 1 and f"round 0: {n} node(s)" in health[0]
    assert f"{n} nodes passed their health checks in 3-9 ms" in health[0]
    every = inspect("--verbose", "--tail", "1", str(run)).stdout.splitlines()
    health = [ln for ln in every if "health checks" in ln]
    assert len(health) == 4 and all(f"{n} nodes passed their health checks in 3-9 ms" in ln for ln in health)
    assert "(200 ranks: the 8 with faults, hangs or the longest heartbeat gaps shown" in res.stdout
    assert "  0-199  " in res.stdout  # one timeouts row for all ranks
    one = inspect("--node", "gpu014", str(run))
    assert "  14    gpu014" in one.stdout and "gpu015" not in one.stdout.split("\nRanks\n")[1]
    rep = json.loads(inspect("--json", "--node", "gpu014", str(run)).stdout)
    assert {f["node"] for f in rep["faults"]} == {"gpu014"} and [r["rank"] for r in rep["ranks"]] == [14]


def test_every_json_entry_of_a_resume_chain_is_tied_to_its_job_and_the_html_has_both(tmp_path):
    logs = tmp_path / "logs"
    resume = EventLog(tmp_path / "state" / "resume.jsonl", "resume")
    for j, t0 in enumerate((T, T + 1000)):
        resume.emit(ResumeAttemptStart(attempt=j + 1, job_id=str(j), command=["nvrx"]), t=t0 - 1)
        c = Cluster(logs / f"job{j}", 2, run_id=f"job{j}", t0=t0)
        c.round(0, t0 + 5, [0, 1], "interrupted" if j == 0 else "succeeded",
                StopDetail(signal="SIGTERM", signum=15) if j == 0 else StopDetail(nodes=2))
        c.end(t0 + 60, {0: 143, 1: 143} if j == 0 else {})
        resume.emit(ResumeAttemptEnd(attempt=j + 1, exit_code=143 if j == 0 else 0, cause="interrupted",
                                     finished=j == 1), t=t0 + 61)
        resume.emit(ResumeDecision(action="continue" if j == 0 else "finished", reason="x"), t=t0 + 62)
    resume.close()
    rep = json.loads(inspect("--json", str(logs), str(tmp_path / "state")).stdout)
    assert [j["status"] for j in rep["jobs"]] == ["interrupted", "succeeded"]
    by_kind = {}
    for it in rep["timeline"]:
        assert it["job"] is not None, it
        by_kind.setdefault(it["kind"], []).append(it["job"])
    assert by_kind["resume:resume_attempt_start"] == [0, 1]  # an attempt's start: the job it starts
    assert by_kind["resume:resume_decision"] == [0, 1]       # a decision: the job it is about
    page = tmp_path / "chain.html"
    assert inspect("--html", str(page), str(logs), str(tmp_path / "state")).returncode == 0
    html = page.read_text()
    assert html.count('<rect class="job"') == 2 and "job0" in html and "job1" in html


def test_follow_rewrites_the_html_as_the_run_goes_on(tmp_path):
    run = tmp_path / "live"
    c = Cluster(run, 2)
    c.round(0, T + 5, [0, 1], "failed", StopDetail(rank=0, local_rank=0, group_rank=0, pid=10_000, exitcode=2,
                                                      tail=["first fault"]))
    page = tmp_path / "live.html"
    proc = subprocess.Popen([sys.executable, "-m", "nvrx", "inspect", "-f", "--interval", "0.2", "--html", str(page),
                             str(run)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: page.exists() and "first fault" in page.read_text(), 60)
        c.round(1, T + 70, [0, 1], "failed", StopDetail(rank=1, local_rank=0, group_rank=1, pid=20_001, exitcode=3,
                                                          tail=["second fault"]))
        for log in c.agents + c.mons:
            log.close()
        assert wait_for(lambda: "second fault" in page.read_text(), 60)
        assert not list(tmp_path.glob(".live.html.tmp-*"))  # written by rename: never half a file
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err
