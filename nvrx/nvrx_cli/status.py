"""Short human status lines on the terminal, one per notable agent event (rich).

Fields are read through the event records' names (``nvrx.events``), like ``nvrx inspect`` reads them.
"""

from __future__ import annotations

from typing import Any, Callable

from rich.console import Console
from rich.markup import escape

from nvrx.events import (AgentKilledRank, AgentSignal, Event, HealthCheckInfo, InprocessRankLost, JobEnd,
                             JobFailure, MonitorGaveUp, NodeHealth, RankExit, RankStuck, RdzvRound, RdzvStandby, RdzvStop, StopDetail)
from nvrx.launcher.agent.error_file import report_lines
from nvrx.common import exit_codes


class StatusPrinter:
    """Subscribed to the agent's EventLog; renders a few events as one line each on stderr."""

    def __init__(self, quiet: bool = False, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.quiet = quiet
        self._stopping = False  # after a stop record, rank exits are ours (SIGTERM/SIGKILL): not news
        self._render: dict[str, Callable[[dict[str, Any]], str | None]] = {
            cls.EV: getattr(self, name) for cls, name in RENDERED.items()}

    def __call__(self, e: dict[str, Any]) -> None:
        render = self._render.get(e["ev"])
        if render is None or self.quiet and e["ev"] != JobEnd.EV:
            return
        text = render(e)
        if text:
            self.console.print(f"[dim]nvrx[/dim] {text}")

    def _rdzv_round(self, e: dict[str, Any]) -> str:
        f = RdzvRound.F
        self._stopping = False
        return (f"round {e.get(f.round)}: {len(e.get(f.nodes) or [])} node(s), world size {e.get(f.world_size)}, "
                f"this node is group rank {e.get(f.group_rank)} "
                f"(restarts so far {e.get(f.restart_count)}, rendezvous {e.get(f.waited) or 0:.2f} s)")

    def _rdzv_standby(self, e: dict[str, Any]) -> str:
        return f"round {e.get(RdzvStandby.F.round)} is full; waiting as a standby node for the next round"

    def _rank_exit(self, e: dict[str, Any]) -> str | None:
        f = RankExit.F
        if e.get(f.exitcode) == 0 or self._stopping:
            return None
        how = f"signal {e[f.signal]}" if e.get(f.signal) else f"exit code {e.get(f.exitcode)}"
        return (f"[red]rank {e.get(f.rank)}[/red] (local {e.get(f.local_rank)}, pid {e.get(f.pid)}) "
                f"ended with {how}")

    def _rank_stuck(self, e: dict[str, Any]) -> str:
        f = RankStuck.F
        return (f"[red]rank {e.get(f.rank)} (pid {e.get(f.pid)}) did not die after SIGKILL "
                f"({escape(str(e.get(f.state)))}); abandoned[/red]")

    def _agent_killed_rank(self, e: dict[str, Any]) -> str:
        f = AgentKilledRank.F
        return (f"[yellow]rank {e.get(f.rank)} (pid {e.get(f.pid)}) still running {e.get(f.waited) or 0:.1f} s after "
                f"{e.get(f.after)} (--term-timeout): sent {e.get(f.signal)}[/yellow]")

    def _inprocess_rank_lost(self, e: dict[str, Any]) -> str:
        f = InprocessRankLost.F
        how = f"signal {e[f.signal]}" if e.get(f.signal) else f"exit code {e.get(f.exitcode)}"
        return (f"[yellow]rank {e.get(f.rank)}[/yellow] ended with {how}; the other ranks restart in process "
                f"without it")

    def _node_health(self, e: dict[str, Any]) -> str | None:
        f, c = NodeHealth.F, HealthCheckInfo.F
        if e.get(f.ok) is not False:
            return None
        failed = [x for x in e.get(f.checks) or [] if isinstance(x, dict) and x.get(c.status) == "failed"]
        why = "; ".join(f"{x.get(c.name)}: {x.get(c.detail)}" for x in failed)
        return f"[red]this node failed its health checks ({escape(why)}); it leaves the job (exit 16)[/red]"

    def _monitor_gave_up(self, e: dict[str, Any]) -> str:
        f = MonitorGaveUp.F
        return (f"[red]the rank monitor of local rank {e.get(f.local_rank)} died {e.get(f.deaths)} times; "
                f"not restarting it (see {escape(str(e.get(f.log)))})[/red]")

    def _rdzv_stop(self, e: dict[str, Any]) -> str | None:
        f, d = RdzvStop.F, StopDetail.F
        self._stopping = True
        kind = e.get(f.kind)
        if kind == "succeeded":
            return None
        detail = e.get(f.detail) or {}
        if kind == "failed":
            cause = detail.get(d.describe) or unnamed_failure(detail.get(d.rank), e.get(f.by_node))
        elif kind == "node_left":
            cause = f"node {detail.get(d.node)} left"
        elif kind == "interrupted":
            cause = f"{detail.get(d.signal)} received"
        else:
            cause = str(kind).replace("_", " ")
        if e.get(f.give_up):
            return (f"[red]stopping: {escape(str(cause))}; restarts used up "
                    f"({(e.get(f.restart_count) or 1) - 1} done)[/red]")
        if kind in ("failed", "node_left"):
            return f"[yellow]restarting the job (restart {e.get(f.restart_count)}): {escape(str(cause))}[/yellow]"
        return f"stopping ranks: {escape(str(cause))}"

    def _agent_signal(self, e: dict[str, Any]) -> str:
        return f"{e.get(AgentSignal.F.signal)} received: forwarding to ranks and stopping"

    def _job_end(self, e: dict[str, Any]) -> str:
        f, jf = JobEnd.F, JobFailure.F
        status, seconds, code = e.get(f.status), e.get(f.seconds) or 0, e.get(f.exit_code)
        if status == "succeeded":
            return f"[green]job finished[/green] in {seconds:.1f} s"
        if status == "already_finished":
            return "the job had already ended before this node joined"
        if status == "interrupted":
            return (f"[yellow]job stopped on a signal[/yellow] after {seconds:.1f} s (exit code "
                    f"{code}: interrupted, resume it)")
        if status == "steered":
            meaning = exit_codes.STEERING_MEANINGS.get(code, "")
            by = escape(str(e[f.detail])) if e.get(f.detail) else "a rank's exit code"
            return f"[yellow]job ended by {by} (exit code {code})[/yellow] ({meaning})"
        lines = [f"[red]job failed[/red] after {seconds:.1f} s (exit code {code})"]
        for fail in e.get(f.failures) or []:
            if fail.get(jf.kind) == "node_left":
                lines.append(f"  round {fail.get(jf.round)}: node {escape(str(fail.get(jf.node)))} left the job")
                continue
            said = fail.get(jf.describe) or unnamed_failure(fail.get(jf.rank), fail.get(jf.node))
            lines.append(f"  round {fail.get(jf.round)}: {escape(str(said))}")
            if fail.get(jf.error):  # the rank recorded its exception: torchrun's failure fields, traceback
                lines += [f"    {escape(x)}" for x in report_lines(fail)]
                continue
            for tail in (fail.get(jf.tail) or [])[-10:]:
                lines.append(f"    | {escape(tail)}")
        return "\n".join(lines)


def unnamed_failure(rank: Any, by_node: Any) -> str:
    """A failed stop without the agent's description (a record nvrx did not write): who reported it, and the
    rank if it names one, instead of "rank None failed"."""
    who = f"node {by_node}" if by_node else "an unnamed node"
    return f"rank {rank} failed (reported by {who})" if rank is not None else f"{who} reported a failure naming no rank"


# The agent events shown on the terminal, and their renderers (others are only logged).
RENDERED: dict[type[Event], str] = {
    RdzvRound: "_rdzv_round",
    RdzvStandby: "_rdzv_standby",
    RankExit: "_rank_exit",
    RankStuck: "_rank_stuck",
    AgentKilledRank: "_agent_killed_rank",
    InprocessRankLost: "_inprocess_rank_lost",
    MonitorGaveUp: "_monitor_gave_up",
    NodeHealth: "_node_health",
    RdzvStop: "_rdzv_stop",
    AgentSignal: "_agent_signal",
    JobEnd: "_job_end",
}
