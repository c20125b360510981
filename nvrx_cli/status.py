"""Short human status lines on the terminal, one per notable agent event (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from nvrx_common import exit_codes
class StatusPrinter:
    """Subscribed to the agent's EventLog; renders a few events as one line each on stderr."""

    def __init__(self, quiet: bool = False) -> None:
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.quiet = quiet
        self._stopping = False  # after a stop record, rank exits are ours (SIGTERM/SIGKILL): not news

    def __call__(self, e: dict[str, Any]) -> None:
        render = getattr(self, "_" + e["ev"], None)
        if render is None or self.quiet and e["ev"] not in ("job_end",):
            return
        text = render(e)
        if text:
            self.console.print(f"[dim]nvrx[/dim] {text}")

    def _rdzv_round(self, e: dict[str, Any]) -> str:
        self._stopping = False
        return (f"round {e.get('round')}: {len(e.get('nodes') or [])} node(s), world size {e.get('world_size')}, "
                f"this node is group rank {e.get('group_rank')} "
                f"(restarts so far {e.get('restart_count')}, rendezvous {e.get('seconds', 0):.2f} s)")

    def _rdzv_standby(self, e: dict[str, Any]) -> str:
        return f"round {e.get('round')} is full; waiting as a standby node for the next round"

    def _rank_exit(self, e: dict[str, Any]) -> str | None:
        if e.get("exitcode") == 0 or self._stopping:
            return None
        how = f"signal {e['signal']}" if e.get("signal") else f"exit code {e.get('exitcode')}"
        return f"[red]rank {e.get('rank')}[/red] (local {e.get('local_rank')}, pid {e.get('pid')}) ended with {how}"

    def _rank_stuck(self, e: dict[str, Any]) -> str:
        return f"[red]rank {e.get('rank')} (pid {e.get('pid')}) did not die after SIGKILL ({e.get('status')}); abandoned[/red]"

    def _rdzv_stop(self, e: dict[str, Any]) -> str | None:
        self._stopping = True
        kind = e.get("kind")
        if kind == "succeeded":
            return None
        detail = e.get("detail") or {}
        if kind == "failed":
            cause = detail.get("describe") or f"rank {detail.get('rank')} failed"
        elif kind == "node_left":
            cause = f"node {detail.get('node')} left"
        elif kind == "interrupted":
            cause = f"{detail.get('signal')} received"
        else:
            cause = kind.replace("_", " ")
        if e.get("give_up"):
            return f"[red]stopping: {escape(str(cause))}; restarts used up ({e.get('restart_count') - 1} done)[/red]"
        if kind in ("failed", "node_left"):
            return f"[yellow]restarting the job (restart {e.get('restart_count')}): {escape(str(cause))}[/yellow]"
        return f"stopping ranks: {escape(str(cause))}"

    def _agent_signal(self, e: dict[str, Any]) -> str:
        return f"{e.get('signal')} received: forwarding to ranks and stopping"

    def _job_end(self, e: dict[str, Any]) -> str:
        status = e.get("status")
        if status == "succeeded":
            return f"[green]job finished[/green] in {e.get('seconds', 0):.1f} s"
        if status == "already_finished":
            return "the job had already ended before this node joined"
        if status == "interrupted":
            return (f"[yellow]job stopped on a signal[/yellow] after {e.get('seconds', 0):.1f} s (exit code "
                    f"{e.get('exit_code')}: interrupted, resume it)")
        if status == "steered":
            meaning = exit_codes.STEERING_MEANINGS.get(e.get("exit_code"), "")
            return f"[yellow]job ended by a rank's exit code {e.get('exit_code')}[/yellow] ({meaning})"
        lines = [f"[red]job failed[/red] after {e.get('seconds', 0):.1f} s (exit code {e.get('exit_code')})"]
        for f in e.get("failures") or []:
            if f.get("kind") == "node_left":
                lines.append(f"  round {f.get('round')}: node {escape(str(f.get('node')))} left the job")
                continue
            lines.append(f"  round {f.get('round')}: {escape(str(f.get('describe')))}")
            for tail in (f.get("tail") or [])[-10:]:
                lines.append(f"    | {escape(tail)}")
        return "\n".join(lines)
