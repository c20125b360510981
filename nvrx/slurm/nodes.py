"""The Slurm job a driver runs in, and which of its nodes to exclude next time.

A rank that exits 16 asks to resume on different hardware; the node to avoid is found in the agents'
event logs (the agent whose rank exited 16 claimed the round's stop record).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from nvrx.events import NodeHealth, RdzvJoin, RdzvStop, StopDetail, field_problem, read_events
from nvrx.common import exit_codes
from nvrx.slurm.environment import SlurmEnvError, expand_hostlist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlurmFacts:
    """The Slurm job this driver runs in (all empty outside Slurm); taken from the environment by the CLI."""

    job_id: str | None = None
    node_name: str | None = None  # SLURMD_NODENAME
    nodelist: str | None = None  # SLURM_JOB_NODELIST (hostlist expression)
    num_nodes: int | None = None
    restart_count: int = 0  # SLURM_RESTART_COUNT (requeues of this job id)
    submit_dir: Path | None = None  # SLURM_SUBMIT_DIR: where the continuation is submitted from

    @property
    def run_key(self) -> str | None:
        """This execution of the job (a requeued job keeps its id)."""
        if not self.job_id:
            return None
        return self.job_id if not self.restart_count else f"{self.job_id}+requeue{self.restart_count}"

    def exclude_target(self, scope: str, bad_node: str | None = None) -> str | None:
        """The node(s) to avoid next time when a rank asks for different hardware (exit 16).

        BAD_NODE is the node whose rank exited 16 (from the agents' logs, see find_bad_node). Without it
        only a one-node job can tell: in a multi-node job this driver's node (the batch host) is not
        necessarily the bad one, so nothing is excluded rather than a healthy node."""
        if scope == "job":
            return self.nodelist or self.node_name
        if bad_node:
            return bad_node
        if self.num_nodes is None or self.num_nodes == 1:
            return self.node_name or (self.nodelist if self.num_nodes == 1 else None)
        return None


_AGENT_FILE = re.compile(r"^agent-(?P<node>.+)-(?P<pid>\d+)\.jsonl$")


def find_bad_node(log_dir: Path | None, job_id: str | None, since: float | None = None) -> str | None:
    """The node (Slurm node name) whose rank ended the launch with exit 16 (or that failed its health checks),
    from the agents' event logs.

    Every agent writes ``<log-dir>/<run-id>/agent-<node>-<pid>.jsonl``; the agent whose rank exited 16
    claims the round's stop record (``rdzv_stop``, kind ``failed``, ``detail.steer`` 16, ``by_node`` = its
    own rendezvous id from ``rdzv_join``). The run dir of JOB_ID is searched first, else every run dir;
    stops before SINCE (the attempt's start) are ignored. The newest such stop wins; None if none is found.
    """
    if log_dir is None or not log_dir.is_dir():
        return None
    preferred = log_dir / job_id if job_id else None
    dirs = [preferred] if preferred is not None and preferred.is_dir() else [log_dir, *_subdirs(log_dir)]
    found: list[tuple[float, str]] = []
    for d in dirs:
        for path in sorted(d.glob("agent-*.jsonl")):
            m = _AGENT_FILE.match(path.name)
            try:
                if m is None or (since is not None and path.stat().st_mtime < since - 1):
                    continue
            except OSError:
                continue
            t = _steer_stop_time(path, since)
            if t is not None:
                found.append((t, m["node"]))
    return max(found)[1] if found else None


def is_job_node(node: str, nodelist: str | None) -> bool:
    """NODE is one of the job's nodes (always true when the node list is unknown or unreadable)."""
    if not nodelist:
        return True
    try:
        return node in expand_hostlist(nodelist)
    except (SlurmEnvError, ValueError):
        return True


def _subdirs(d: Path) -> list[Path]:
    try:
        return sorted(p for p in d.iterdir() if p.is_dir())
    except OSError:
        return []


def _steer_stop_time(path: Path, since: float | None) -> float | None:
    """When this agent claimed a stop for its rank's exit 16, or left on a failed node health check (the newest)."""
    own: set[str] = set()
    newest = None
    try:
        for e in read_events(path):
            if isinstance(e, str) or field_problem(e) is not None:
                continue  # a corrupt line or a wrongly typed record: skipped, as nvrx inspect does
            if e["ev"] == RdzvJoin.EV and e.get(RdzvJoin.F.node_id) is not None:
                own.add(e[RdzvJoin.F.node_id])
            elif (e["ev"] == RdzvStop.EV and e.get(RdzvStop.F.kind) == "failed" and e.get(RdzvStop.F.by_node) in own
                  and (e.get(RdzvStop.F.detail) or {}).get(StopDetail.F.steer) == exit_codes.RESUME_ELSEWHERE
                  and (since is None or e["t"] >= since)):
                newest = e["t"]
            elif e["ev"] == NodeHealth.EV and e.get(NodeHealth.F.ok) is False and (since is None or e["t"] >= since):
                newest = e["t"]  # the agent left the job because its node failed a health check
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
    return newest
