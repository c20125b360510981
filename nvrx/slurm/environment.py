"""What a Slurm job tells `nvrx launch` through its environment: nodes, this node's rank, the job id.

Inside `srun --ntasks-per-node=1 nvrx launch ...` every agent can work out the whole topology
without flags: the step's node list (Slurm's compressed hostlist syntax, expanded here), this
node's index in it, and the job id, which names the rendezvous and spreads the rendezvous port
so that consecutive jobs on the same first node do not meet on one port. The caller passes the
environment in; nothing here reads os.environ.
"""

from __future__ import annotations

import itertools
import re
import zlib
from dataclasses import dataclass
from typing import Mapping

from nvrx.common.errors import NvrxError
# Rendezvous ports derived from the job id: below the kernel's ephemeral range (32768+), so a
# process-group store or an outgoing connection never holds the port we are about to bind.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
MAX_HOSTS = 100_000  # a hostlist expanding to more names than this is a typo, not a cluster


class SlurmEnvError(NvrxError, ValueError):
    """The Slurm environment cannot be used as it is; the message is one line saying what and how to fix it."""


@dataclass(frozen=True)
class SlurmTopology:
    """The part of a Slurm job (or of its current step) that one nvrx agent runs on."""

    job_id: str
    hosts: tuple[str, ...]  # the step's nodes in Slurm's order (the job's outside a step)
    node_rank: int  # this node's index in hosts
    node_name: str | None  # SLURMD_NODENAME: emulated nodes share a hostname, not this
    in_step: bool  # inside srun (False: a batch script or salloc shell)
    tasks_per_node: int  # the most tasks this step runs on one node

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def rdzv_host(self) -> str:
        """The first node hosts the rendezvous."""
        return self.hosts[0]

    @property
    def rdzv_port(self) -> int:
        return rdzv_port_for_job(self.job_id)


# ---------------------------------------------------------------- hostlists


def _split_top_level(text: str) -> list[str]:
    """Split on commas/whitespace outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    items, cur, depth = [], [], 0
    for ch in text:
        if ch == "[":
            if depth:
                raise SlurmEnvError(f"hostlist {text!r}: brackets cannot nest")
            depth = 1
        elif ch == "]":
            if not depth:
                raise SlurmEnvError(f"hostlist {text!r}: ']' without a matching '['")
            depth = 0
        if depth == 0 and (ch == "," or ch.isspace()):
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SlurmEnvError(f"hostlist {text!r}: '[' is never closed")
    items.append("".join(cur))
    return [item for item in items if item]


def _expand_ranges(body: str, item: str) -> list[str]:
    """'001-003,7' -> ['001', '002', '003', '7']; the low bound's width sets the zero padding."""
    out: list[str] = []
    for part in body.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if not m:
            raise SlurmEnvError(f"hostlist item {item!r}: {part!r} is not a number or a LOW-HIGH range")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if lo > hi:
            raise SlurmEnvError(f"hostlist item {item!r}: range {part.strip()!r} runs backwards")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise SlurmEnvError(f"hostlist item {item!r} names more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        out.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return out


def _expand_item(item: str) -> list[str]:
    """'r[1-2]n[3-4]' -> r1n3 r1n4 r2n3 r2n4 (several bracket groups multiply, leftmost slowest)."""
    pieces = [p for p in re.split(r"(\[[^\]]*\])", item) if p]
    choices = [_expand_ranges(p[1:-1], item) if p.startswith("[") else [p] for p in pieces]
    total = 1
    for c in choices:
        total *= len(c)
    if total > MAX_HOSTS:
        raise SlurmEnvError(f"hostlist item {item!r} names more than {MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names in order, e.g. 'gpu-[001-002],login1' -> 3 names."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_item(item))
        if len(hosts) > MAX_HOSTS:
            raise SlurmEnvError(f"hostlist {text[:60]!r} names more than {MAX_HOSTS} hosts")
    if not hosts:
        raise SlurmEnvError(f"hostlist {text!r} names no host")
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's per-node counts: '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise SlurmEnvError(f"tasks per node {text!r}: {part!r} is not N or N(xREPEAT)")
        out.extend([int(m.group(1))] * min(int(m.group(2) or 1), MAX_HOSTS))
    return out


# ---------------------------------------------------------------- the environment


def rdzv_port_for_job(job_id: str) -> int:
    """A port that differs between consecutive jobs (job ids count up)."""
    num = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return RDZV_PORT_BASE + num % RDZV_PORT_SPAN


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return value
    return None


def _whole(value: str, name: str) -> int:
    if not re.fullmatch(r"\d+", value.strip()):
        raise SlurmEnvError(f"{name}={value!r} is not a whole number; is this really a Slurm job environment?")
    return int(value)


def slurm_topology(env: Mapping[str, str]) -> SlurmTopology | None:
    """The topology Slurm gives this process, or None outside a Slurm job.

    Inside a step (srun) the step's nodes count, not the job's: `srun -N2` in a 3-node job
    runs on two nodes, numbered 0 and 1 by SLURM_NODEID.
    """
    job_id = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    if job_id is None:
        return None
    in_step = _first(env, "SLURM_STEP_ID", "SLURM_STEPID") is not None
    if in_step:
        nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
        count = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        rank_text = _first(env, "SLURM_NODEID") or "0"
        tasks = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    else:  # the batch script or an salloc shell: one process on the job's first node
        nodelist = _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        count = _first(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        rank_text, tasks = "0", None
    if nodelist is None:
        raise SlurmEnvError(f"Slurm job {job_id} without SLURM_JOB_NODELIST in the environment; "
                            "pass --nnodes and --rdzv-endpoint yourself")
    hosts = expand_hostlist(nodelist)
    if count is not None and _whole(count, "SLURM_NNODES") != len(hosts):
        raise SlurmEnvError(f"Slurm says {count} nodes but its node list {nodelist!r} has {len(hosts)}; "
                            "pass --nnodes and --rdzv-endpoint yourself")
    node_rank = _whole(rank_text, "SLURM_NODEID")
    if node_rank >= len(hosts):
        raise SlurmEnvError(f"SLURM_NODEID={node_rank} is outside the node list {nodelist!r}; "
                            "pass --node-rank yourself")
    per_node = max(parse_tasks_per_node(tasks)) if tasks else 1
    return SlurmTopology(job_id=job_id, hosts=tuple(hosts), node_rank=node_rank,
                         node_name=_first(env, "SLURMD_NODENAME"), in_step=in_step, tasks_per_node=per_node)
