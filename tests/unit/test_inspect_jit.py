"""The ``jit_checkpoint`` record (issue 30) and how `nvrx inspect` shows it, in process.

The record round-trips through a real EventLog file; the agent's outcome of its ranks' answers
(``jit_request.outcome``) keeps the log lines it always had; event files of a 40-node run written with the real
writer give one JIT outcome per fault in the default view, on its stop line (the deciding node's, with the step
resumed from), a line of its own under --verbose, a
``jit_checkpoint`` on each --json fault and the HTML faults table; a log written before the record inspects as
before. The runs under `nvrx launch` are tests/ckpt/test_jit_inspect.py.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from nvrx.events import (
    CheckpointComplete,
    EventLog,
    JitAnswer,
    JitCheckpoint,
    MonitorConnect,
    RankExit,
    StopDetail,
    field_problem,
    read_events,
)
from nvrx.inspection.html_report import render_html
from nvrx.inspection.run_report import build_report
from nvrx.launcher.agent.jit_request import outcome
from nvrx.nvrx_cli.inspect_cmd import render_text
from nvrx.nvrx_cli.inspect_text import entry_text, report_dict
from tests.unit.test_timeline import TIMEOUTS, Node, T, _crash_run

SHARDED = "sharded state (DTensor): the shards of lost rank(s) [5] have no other holder"


def _saved(step: int = 13) -> JitCheckpoint:
    return JitCheckpoint(round=0, fault="failed", lost=[1], outcome="saved", step=step, seconds=0.21, waited=0.25,
                         path=f"/ckpts/jit_step_{step:09d}", answers=[JitAnswer(local_rank=0, rank=0, outcome="saved")])


def test_the_record_round_trips_through_an_event_file(tmp_path):
    rec = _saved()
    log = EventLog(tmp_path / "agent-h-1.jsonl", "agent")
    log.emit(rec, t=T)
    log.close()
    (e,) = list(read_events(tmp_path / "agent-h-1.jsonl"))
    assert isinstance(e, dict) and e["ev"] == "jit_checkpoint" and field_problem(e) is None
    back = JitCheckpoint.of({k: v for k, v in e.items() if k not in ("v", "t", "src", "ev")})
    assert back.to_fields() == rec.to_fields() and back.answers[0].outcome == "saved"
    assert "reason" not in e  # None fields are left out of the line
    assert "field 'lost'" in field_problem({**e, "lost": ["1"]})
    assert "field 'answers'" in field_problem({**e, "answers": [{"local_rank": "0", "outcome": "saved"}]})


def test_the_nodes_outcome_from_its_ranks_answers_keeps_the_agents_log_lines():
    saved = {"ok": True, "relayed": True, "saved": True, "step": 13, "seconds": 0.2, "path": "/c/jit_step_13"}
    left = {"ok": True, "relayed": True, "saved": False, "skipped": "rank 0 saves the replicated state"}
    broke = {"ok": True, "relayed": True, "saved": False, "step": 13, "error": SHARDED}
    out = outcome({1: left, 0: saved})
    assert (out.outcome, out.step, out.seconds, out.path) == ("saved", 13, 0.2, "/c/jit_step_13")
    assert out.line == "just-in-time checkpoint of step 13 saved in 0.2 s: /c/jit_step_13"
    assert out.answers == [(0, "saved", None), (1, "skipped", "rank 0 saves the replicated state")]
    out = outcome({0: broke, 1: left})
    assert (out.outcome, out.step, out.reason) == ("failed", 13, SHARDED)
    assert out.line == f"no just-in-time checkpoint ({SHARDED}); the restart resumes from the newest periodic/local checkpoint"
    out = outcome({0: left})
    assert (out.outcome, out.line) == ("skipped", "no just-in-time checkpoint from this node: rank 0 saves the replicated state")
    # every local rank lost: nothing to ask here (another node's rank decides); a monitor that could not be asked fails
    assert (outcome({}).outcome, outcome({}).reason) == ("skipped", "no surviving local rank to ask")
    out = outcome({0: {"saved": False, "error": "no answer within 5 s: abandoned"}})
    assert (out.outcome, out.reason, out.answers) == ("failed", "no answer within 5 s: abandoned",
                                                      [(0, "failed", "no answer within 5 s: abandoned")])


NODES = 40


def _jit_run(run: Path) -> None:
    """NODES nodes of 2 ranks. Round 0: rank 5 (node 2) crashes; node 0's rank 0 saves step 813, the other nodes leave
    it to rank 0. Round 1: rank 5 crashes again; the state is sharded, rank 0 cannot save step 901, and the newest
    complete checkpoint is step 900 (step 950 completes only after the fault). Round 2 succeeds."""
    nodes = [Node(run, f"host{g:02d}", 100 + g) for g in range(NODES)]
    ids = [n.node_id for n in nodes]
    for n in nodes:
        n.start(T, "jitrun", nnodes=f"{NODES}:{NODES}")
    for r in range(3):
        t = T + 100 * r
        pids = [n.round(t, r, ids, r, group_rank=g, run_at=t + 1) for g, n in enumerate(nodes)]
        mon0 = nodes[0].mons[0]
        mon0.emit(MonitorConnect(rank=0, global_rank=0, pid=pids[0][0], generation=1, timeouts=TIMEOUTS), t=t + 1.5)
        if r == 2:
            for n in nodes:
                n.stop(t + 50, r, "succeeded", StopDetail(nodes=NODES), r)
            break
        step = 800 + 100 * r
        mon0.emit(CheckpointComplete(rank=0, global_rank=0, pid=pids[0][0], step=step, tier="global", taken=t + 20),
                  t=t + 21)
        nodes[2].agent.emit(RankExit(local_rank=1, rank=5, pid=pids[2][1], signal="SIGSEGV", attempt=r,
                                     abandoned=False), t=t + 40)
        detail = StopDetail(rank=5, local_rank=1, group_rank=2, pid=pids[2][1], signal="SIGSEGV", abandoned=False,
                            tail=["boom"], describe="x", round=r)
        for n in nodes:
            n.stop(t + 40.1, r, "failed", detail, r + 1)
        for g, n in enumerate(nodes):
            answers = [JitAnswer(local_rank=lr, rank=2 * g + lr, outcome="skipped",
                                 reason="rank 0 saves the replicated state") for lr in (0, 1) if 2 * g + lr != 5]
            rec = JitCheckpoint(round=r, fault="failed", lost=[5], outcome="skipped", waited=0.05, answers=answers,
                                reason="rank 0 saves the replicated state")
            if g == 0 and r == 0:
                answers[0] = JitAnswer(local_rank=0, rank=0, outcome="saved")
                rec = JitCheckpoint(round=r, fault="failed", lost=[5], outcome="saved", step=813, seconds=0.21,
                                    waited=0.3, path="/ckpts/jit_step_000000813", answers=answers)
            elif g == 0:
                answers[0] = JitAnswer(local_rank=0, rank=0, outcome="failed", reason=SHARDED)
                rec = JitCheckpoint(round=r, fault="failed", lost=[5], outcome="failed", step=901, waited=0.1,
                                    reason=SHARDED, answers=answers)
            n.agent.emit(rec, t=t + 40.2 + 0.001 * g)
        if r == 1:  # a periodic save completing after the fault is not what the restart resumed from
            mon0.emit(CheckpointComplete(rank=0, global_rank=0, pid=pids[0][0], step=950, tier="global", taken=t + 30),
                      t=t + 41)
    for n in nodes:
        n.end(T + 250, "succeeded", 0)
        n.close()


def test_a_40_node_run_has_one_jit_line_per_fault_with_the_step_resumed_from(tmp_path):
    _jit_run(tmp_path / "jitrun")
    rep = build_report([tmp_path / "jitrun"])
    text = render_text(rep)
    lines = [ln for ln in text.splitlines() if "just-in-time checkpoint" in ln]
    assert len(lines) == 2, text
    assert "round 0 stopped: rank 5 crashed with SIGSEGV on node host02; restart 1; " in lines[0], lines[0]
    assert lines[0].endswith("; just-in-time checkpoint of step 813 saved in 0.21 s by rank 0; resumed from it")
    assert "round 1 stopped: rank 5 crashed with SIGSEGV on node host02; restart 2; " in lines[1], lines[1]
    assert lines[1].endswith(f"; no just-in-time checkpoint of step 901 ({SHARDED}); resumed from the newest "
                             "periodic/local checkpoint, step 900; its output ends like round 0's"), lines[1]
    verbose = [ln for ln in render_text(rep, verbose=True).splitlines() if ": just-in-time checkpoint" in ln
               or ": no just-in-time checkpoint" in ln]  # every entry: the JIT outcomes are lines of their own
    assert len(verbose) == 2 and "round 0: just-in-time checkpoint of step 813 saved" in verbose[0], verbose
    assert "round 1: no just-in-time checkpoint of step 901 (" in verbose[1], verbose
    data = json.loads(json.dumps(report_dict(rep), default=str))
    jits = [f["jit_checkpoint"] for f in data["faults"]]
    assert [(j["outcome"], j["step"], j["resume_step"], j["node"], j["rank"]) for j in jits] == [
        ("saved", 813, 813, "host00", 0), ("failed", 901, 900, "host00", 0)]
    assert (jits[0]["path"], jits[1]["path"], jits[1]["reason"]) == ("/ckpts/jit_step_000000813", None, SHARDED)
    assert [(len(j["nodes"]), j["nodes_skipped"]) for j in jits] == [(1, NODES - 1), (1, NODES - 1)]
    assert jits[1]["nodes"][0]["answers"][0] == {"local_rank": 0, "rank": 0, "outcome": "failed", "reason": SHARDED}
    assert data["jit_checkpoints"] == jits and all(j["lost"] == [5] and j["fault"] == "failed" for j in jits)
    assert [it["level"] for it in data["timeline"] if it["kind"] == "jit_checkpoint"] == ["ok", "warn"]
    page = render_html(rep, entry_text)
    assert html.escape(jits[1]["text"]) in page and "<th>just-in-time checkpoint</th>" in page


def test_a_log_without_jit_events_inspects_as_before(tmp_path):
    _crash_run(tmp_path / "old")
    rep = build_report([tmp_path / "old"])
    (fault,) = rep.faults
    assert fault["jit_checkpoint"] is None and rep.jit_checkpoints == []
    assert fault["cause"] == "rank 1 exited with code 13"
    assert "just-in-time" not in render_text(rep) and "just-in-time" not in render_text(rep, verbose=True)
    assert '<td class="jit">-</td>' in render_html(rep, entry_text)
