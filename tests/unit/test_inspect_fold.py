"""The default terminal view of `nvrx inspect` folds what repeats per node, per rank and per round, and says so;
--verbose shows every entry; --node / --rank narrow the goodput to that node's or rank's ranks and say whose it is.

In process (no `nvrx` subprocess): event files written with the real writer, read by build_report, rendered by the
CLI's renderers. The 1,024-node case is tests/integration/test_inspect_scale.py.
"""

from __future__ import annotations

import html
from pathlib import Path

import pytest

from nvrx.events import HangDetected, RankExit, StopDetail
from nvrx.inspection.html_report import render_html
from nvrx.inspection.run_report import build_report
from nvrx.inspection.timeline import Filters
from nvrx.nvrx_cli.inspect_cmd import render_text
from nvrx.nvrx_cli.inspect_text import entry_text
from nvrx.nvrx_cli.inspect_view import _ranges, _squeeze
from tests.unit.test_timeline import TIMEOUTS, Node, T


def _hangs_run(run: Path, hung: int, two_sections: bool = False) -> None:
    """One node. Round 0: rank 0 exits 1 and HUNG other ranks' monitors report a hang first (TWO_SECTIONS: the
    second half in section 'ckpt'); round 1 (the same node) fails with output that ends the same way; round 2
    succeeds."""
    n = Node(run, "hostA", 7, nproc=max(6, hung + 1))
    n.start(T, "f")
    for r in range(3):
        t = T + 100 * r
        pids = n.round(t, r, [n.node_id], r, run_at=t + 1)
        if r == 2:
            n.stop(t + 50, r, "succeeded", StopDetail(nodes=1), r)
            break
        for lr in range(1, 1 + hung if r == 0 else 1):
            section = "ckpt" if two_sections and lr > hung // 2 else "step"
            n.mons[lr].emit(HangDetected(rank=lr, pid=pids[lr], generation=1, reason="section_timeout", section=section,
                                         elapsed=31.0, timeout=30.0, timeouts=TIMEOUTS, signal="SIGKILL"), t=t + 40)
        n.agent.emit(RankExit(local_rank=0, rank=0, pid=pids[0], exitcode=1, attempt=r, abandoned=False), t=t + 41)
        tail = ["warning: slow"] * 3 + [f"step {r}", "RuntimeError: boom"]
        n.stop(t + 41, r, "failed", StopDetail(rank=0, local_rank=0, group_rank=0, pid=pids[0], exitcode=1, tail=tail),
               r + 1)
    n.end(T + 250, "succeeded", 0)
    n.close()


def test_per_rank_entries_of_a_round_fold_into_the_first_with_a_count(tmp_path):
    _hangs_run(tmp_path / "f", hung=5)
    rep = build_report([tmp_path / "f"])
    text = render_text(rep)
    hung = [ln for ln in text.splitlines() if "hung in section 'step'" in ln]
    assert len(hung) == 1 and hung[0].endswith("(and 4 more like it: rank(s) 2-5)")
    assert "| warning: slow (x3)" in text and "| RuntimeError: boom" in text
    assert text.count("RuntimeError: boom") == 1  # round 1's output ends the same: said, not quoted again
    assert "round 1 stopped: rank 0 exited with code 1; restart 2; " in text and "its output ends like round 0's" in text
    assert "round 1: 1 node(s)" not in text and "round 0: 1 node(s)" in text  # round 1 starts like round 0
    assert "(folded: 2 round start(s) like the round before, 4 per-node entries in 1 group(s);" in text
    assert "\nFaults and stops\n" not in text
    verbose = render_text(rep, verbose=True)
    assert sum(1 for ln in verbose.splitlines() if "hung in section 'step'" in ln) == 5
    assert "round 1: 1 node(s)" in verbose and verbose.count("RuntimeError: boom") == 2  # both quoted
    assert "\nFaults and stops\n" in verbose and "folded" not in verbose
    assert "goodput: progress kept" in verbose and "goodput: progress kept" not in text  # definitions: --verbose


def test_a_few_per_rank_entries_are_not_folded(tmp_path):
    _hangs_run(tmp_path / "few", hung=3)
    text = render_text(build_report([tmp_path / "few"]))
    assert sum(1 for ln in text.splitlines() if "hung in section 'step'" in ln) == 3 and "more like it" not in text


def test_only_entries_alike_fold_together(tmp_path):
    """Hangs in two sections in one round: two folds, one per section (names and numbers aside, the same words)."""
    _hangs_run(tmp_path / "two", hung=8, two_sections=True)
    text = render_text(build_report([tmp_path / "two"]))
    hung = [ln for ln in text.splitlines() if "; monitor sent SIGKILL" in ln]
    assert len(hung) == 2, text
    assert "in section 'step'" in hung[0] and hung[0].endswith("(and 3 more like it: rank(s) 2-4)")
    assert "in section 'ckpt'" in hung[1] and hung[1].endswith("(and 3 more like it: rank(s) 6-8)")


def test_a_node_or_rank_filter_shows_every_entry(tmp_path):
    _hangs_run(tmp_path / "f", hung=5)
    text = render_text(build_report([tmp_path / "f"], Filters(node="hostA")))
    assert sum(1 for ln in text.splitlines() if "hung in section 'step'" in ln) == 5 and "folded" not in text


def test_goodput_under_node_is_that_nodes_ranks_and_names_the_whole_jobs(tmp_path):
    """hostA's rank steps 60 s of the round, hostB's 30 s: the job's goodput is their mean, each node's its own."""
    run = tmp_path / "two"
    a, b = Node(run, "hostA", 7, nproc=1), Node(run, "hostB", 8, nproc=1)
    ids = [a.node_id, b.node_id]
    for g, n in enumerate((a, b)):
        n.start(T, "two", nnodes="2:2")
        (pid,) = n.round(T, 0, ids, 0, group_rank=g, run_at=T + 10)
        n.steps(0, pid, T + 10, T + 70 if n is a else T + 40, step_s=0.5)
        n.stop(T + 70, 0, "succeeded", StopDetail(nodes=2), 0)
        n.end(T + 70, "succeeded", 0)
        n.close()
    job = build_report([run])
    assert job.goodput_scope == "job" and job.goodput == pytest.approx(45 / 70, abs=1e-3)
    assert "(node " not in render_text(job) and "job-wide" not in render_text(job)
    for host, kept in (("hostA", 60), ("hostB", 30)):
        rep = build_report([run], Filters(node=host))
        assert rep.goodput_scope == f"node {host}" and rep.to_dict()["goodput_scope"] == f"node {host}"
        assert rep.goodput == pytest.approx(kept / 70, abs=1e-3)
        assert rep.time_accounting["job_goodput"] == job.goodput
        text = render_text(rep)
        assert f"goodput {kept / 70 * 100:.1f} % (node {host}'s ranks, from 'step' sections)" in text
        assert f"the whole job: {job.goodput * 100:.1f} %" in text and "uptime 85.7 % (job-wide)" in text
        card = html.escape(f"of node {host}'s ranks (the whole job: {job.goodput * 100:.1f} %)", quote=True)
        assert card in render_html(rep, entry_text)
    one = build_report([run], Filters(rank=1))
    assert one.goodput_scope == "rank 1" and one.goodput == pytest.approx(30 / 70, abs=1e-3)
    assert "goodput 42.9 % (rank 1, from 'step' sections)" in render_text(one)


def test_ranks_and_repeated_lines_in_few_words():
    assert _ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert _ranges(list(range(0, 40, 2))) == "0,2,4,6,8,10,12,14,... (+12 more)"
    assert _squeeze(["a", "a", "b", "a"]) == ["a (x2)", "b", "a"]
    assert _squeeze([]) == []


def test_a_node_filter_naming_no_node_of_the_run_is_a_usage_error(tmp_path):
    import click

    from nvrx.nvrx_cli.inspect_cmd import check_node

    _hangs_run(tmp_path / "f", hung=1)
    rep = build_report([tmp_path / "f"])
    for known in ("hostA", "hostA-7", "hostA-7-abcdef"):  # its name, <host>-<pid>, its rendezvous id
        check_node(rep, known)
    with pytest.raises(click.UsageError) as err:
        check_node(rep, "hostB")
    assert err.value.format_message() == "--node hostB: no such node in this run; its nodes: hostA"
