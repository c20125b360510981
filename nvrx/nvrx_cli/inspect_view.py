"""The timeline rows `nvrx inspect` prints: folded by default, so a 1,000-node, 10-round run fits about a screen.

The report keeps every entry (``--json``, ``--html``, ``--follow`` show them all); only the terminal view folds:

* per-node or per-rank entries of one kind and shape (the same sentence but for names and numbers) between two
  round boundaries: more than ``FOLD_AT`` become the first one, which says how many more and who (``(and 163 more
  like it: rank(s) 4,17,...)``);
* the health checks the nodes of a round passed are said on that round's line;
* a fault's just-in-time checkpoint (``--jit-ckpt``: every node's agent logs its ranks' answers; the report merges
  them into one outcome per fault) is said on the fault's stop line;
* a round that starts like the one before it (the same nodes, every rank running) is not a line of its own: the
  stop before it says its time lost (to all ranks running again);
* a failing rank's output lines: repeated lines once with a count; output that ends like an earlier fault's
  (the same error) is not quoted again: the stop's line says which round's it is like.

``--verbose`` (and ``--rank`` / ``--node``, which ask for the details of one rank or node) shows every entry.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nvrx.inspection.run_report import Report
from nvrx.inspection.timeline import Entry
from nvrx.nvrx_cli.inspect_text import duration, entry_text

FOLD_AT = 3             # more per-node entries of one kind in one round than this are folded into a count
WHO_SHOWN = 8           # ranks or nodes named on a folded entry's line
_DIGITS = re.compile(r"\d+")
BOUNDARIES = frozenset({"round", "stop", "job", "job_end", "job_open"})  # Entry.key[0] of the entries that cut groups


@dataclass
class Row:
    """One timeline line of the terminal view, with the output lines quoted under it."""

    t: float
    level: str
    text: str
    tail: list[str] = field(default_factory=list)


@dataclass
class Folded:
    """What the folded view left out, for the one line that says so."""

    rounds: int = 0
    entries: int = 0
    groups: int = 0

    def note(self) -> str | None:
        parts = []
        if self.rounds:
            parts.append(f"{self.rounds} round start(s) like the round before")
        if self.entries:
            parts.append(f"{self.entries} per-node entries in {self.groups} group(s)")
        if not parts:
            return None
        return f"(folded: {', '.join(parts)}; --verbose, --rank N or --node NAME shows every entry)"


def folds(report: Report) -> bool:
    """Whether the default view folds: not when a filter asks for one rank's or one node's details."""
    f = report.filters
    return f.get("rank") is None and f.get("node") is None


def timeline_rows(report: Report, tail_lines: int, verbose: bool) -> tuple[list[Row], Folded]:
    """The timeline as the terminal shows it (every entry with VERBOSE), and what was folded."""
    if verbose or not folds(report):
        rows = [Row(it.t, it.level, entry_text(it) + repeats(it), _cut(it.tail, tail_lines)) for it in report.items]
        return rows, Folded()
    folder = _Folder(report, tail_lines)
    rows = [row for i, it in enumerate(report.items) if (row := folder.row(i, it)) is not None]
    return rows, folder.folded


class _Folder:
    """The default view's rows, one entry at a time, with what it needs to know about the others."""

    def __init__(self, report: Report, tail_lines: int) -> None:
        items = report.items
        self.items = items
        self.tail_lines = tail_lines
        self.folded = Folded()
        self.groups = _groups(items)
        self.lost = {(f["job"], f["round"]): f.get("lost_s") for f in report.faults}
        self.health = {(it.job, it.round): it for it in items if it.key[0] == "health_ok"}
        self.rounds = {(it.job, it.round) for it in items if it.key[0] == "round"}
        self.routine = _routine_rounds(report)
        self.quoted: dict[str, int | None] = {}  # the last output line of a fault quoted so far -> its round
        stops = {(it.job, it.round) for it in items if it.key[0] == "stop"}
        self.jit = {(f["job"], f["round"]): f["jit_checkpoint"]["text"] for f in report.faults
                    if f.get("jit_checkpoint") and (f["job"], f["round"]) in stops}  # said on the stop's line

    def row(self, i: int, it: Entry) -> Row | None:
        """Entry I's row, or None when another row says it (or it is a routine round start)."""
        kind, where = it.key[0], (it.job, it.round)
        group = self.groups.get(i)
        if (kind == "health_ok" and where in self.rounds) or (group is not None and group[0] != i):
            return None
        if kind == "round" and where in self.routine:
            self.folded.rounds += 1
            return None
        if kind == "jit" and where in self.jit:
            return None
        text = entry_text(it) + repeats(it)
        if kind == "round" and where in self.health:
            text += f"; {entry_text(self.health[where])}"
        if kind == "stop" and where in self.lost:
            lost = self.lost[where]
            text += f"; {duration(lost)} lost" if lost is not None else "; not recovered"
        if kind == "stop" and where in self.jit:
            text += f"; {self.jit[where]}"
        if group is not None:
            self.folded.entries += len(group) - 1
            self.folded.groups += 1
            text += _count_words([self.items[j] for j in group[1:]])
        said, tail = self._output(it)
        return Row(it.t, it.level, text + said, tail)

    def _output(self, it: Entry) -> tuple[str, list[str]]:
        """A failing rank's last output lines, a run of one line once with its count; output ending like an earlier
        fault's (the same error) is named on the entry's line instead: (words for that line, lines to quote)."""
        tail = _squeeze(it.tail)[-self.tail_lines:] if self.tail_lines else []
        if not tail:
            return "", []
        if tail[-1] not in self.quoted:
            self.quoted[tail[-1]] = it.round
            return "", tail
        before = self.quoted[tail[-1]]
        return (f"; its output ends like round {before}'s" if before is not None else
                "; its output ends like an earlier fault's"), []


def repeats(it: Entry) -> str:
    return f" (and {it.repeats} more times, the same)" if it.repeats else ""


def _cut(tail: list[str], n: int) -> list[str]:
    return tail[-n:] if n else []


def _groups(items: list[Entry]) -> dict[int, list[int]]:
    """Index of each entry that is folded -> the indices of its group (per-node entries of one kind between two
    round boundaries, more than FOLD_AT of them)."""
    segment = 0
    by_key: dict[tuple, list[int]] = {}
    for i, it in enumerate(items):
        if it.key[0] in BOUNDARIES:
            segment += 1
            continue
        if it.key[0] == "health_ok" or (it.node is None and it.rank is None):
            continue
        by_key.setdefault((segment, it.job, it.kind, it.level, _shape(it)), []).append(i)
    out: dict[int, list[int]] = {}
    for members in by_key.values():
        if len(members) > FOLD_AT:
            for i in members:
                out[i] = members
    return out


def _shape(it: Entry) -> str:
    """An entry's sentence less what differs from node to node and rank to rank (its node's name, numbers): entries
    of one shape are "like it" (ranks hung in one section; not a forged stop record and a forged join record)."""
    text = entry_text(it)
    if it.node:
        text = text.replace(str(it.node), "<node>")
    return _DIGITS.sub("#", text)


def _count_words(rest: list[Entry]) -> str:
    """What stands for the folded entries on the first one's line: how many, and who."""
    ranks = sorted({it.rank for it in rest if isinstance(it.rank, int)})
    nodes = sorted({str(it.node) for it in rest if it.node is not None})
    if ranks:
        who = f"rank(s) {_ranges(ranks)}" + (f" on {len(nodes)} node(s)" if len(nodes) > 1 else "")
    else:
        who = f"node(s) {_names(nodes)}"
    return f" (and {len(rest)} more like it: {who})"


def _ranges(nums: list[int]) -> str:
    """0-3,7,9-12: the first WHO_SHOWN runs of consecutive ranks, then how many ranks more."""
    runs: list[tuple[int, int]] = []
    for n in nums:
        if runs and n == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    shown = runs[:WHO_SHOWN]
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    rest = len(nums) - sum(b - a + 1 for a, b in shown)
    return text + (f",... (+{rest} more)" if rest else "")


def _names(names: list[str]) -> str:
    more = f", ... (+{len(names) - WHO_SHOWN} more)" if len(names) > WHO_SHOWN else ""
    return ", ".join(names[:WHO_SHOWN]) + more


def _routine_rounds(report: Report) -> set[tuple[int, int]]:
    """(job, round) of rounds that start like the round before them: the same nodes, every rank running."""
    out = set()
    for job in report.jobs:
        before: Iterable[Any] | None = None
        for rd in job["rounds"]:
            nodes = set(rd["node_ids"] or [])
            if before is not None and nodes == before and rd.get("ranks_running_at") is not None:
                out.add((job["index"], rd["round"]))
            before = nodes
    return out


def _squeeze(lines: list[str]) -> list[str]:
    """Runs of the same line as one line with its count: a rank that printed one warning 500 times."""
    out: list[str] = []
    count = 0
    for i, line in enumerate(lines):
        count += 1
        if i + 1 < len(lines) and lines[i + 1] == line:
            continue
        out.append(f"{line} (x{count})" if count > 1 else line)
        count = 0
    return out
