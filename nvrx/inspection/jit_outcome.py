"""A fault's just-in-time checkpoint (``nvrx launch --jit-ckpt``) as `nvrx inspect` shows it: one outcome per fault.

Every agent asks its own surviving ranks and logs what they answered (``jit_checkpoint``): on a 1,000-node job one
node's rank saves (or tries to) and 999 nodes say they left it to that rank. A person wants one line per fault:
``merge`` picks the node whose answer decides (a save wins, then a failed attempt, then a skip that knows a step)
and keeps the others' answers for ``--json`` (every node that did not just skip, and how many did).

The step the restart resumed from is not logged by anyone: it is what ``resume()`` loads, the newest complete
checkpoint. A saved JIT checkpoint is that; otherwise it is the newest step nvrx's checkpointers reported complete
(``checkpoint_complete``) before the JIT outcome, when they reported any.
"""

from __future__ import annotations

from typing import Any

from nvrx.events import JitAnswer, JitCheckpoint
from nvrx.inspection.event_files import iso

_ORDER = {"saved": 0, "failed": 1, "skipped": 2}  # which node's answer decides a fault's outcome (unknown: as failed)
LEVEL = {"saved": "ok", "failed": "warn", "skipped": "info"}
FALLBACK = "the newest periodic/local checkpoint"


def merge(events: list[dict[str, Any]], ckpts: list[tuple[float, Any]], resumed: bool) -> dict[str, Any]:
    """One fault's JIT outcome from its nodes' jit_checkpoint EVENTS (fields + t, node), the complete checkpoints
    reported in the run (CKPTS: (completion time, step)), and whether the job went on after the fault (RESUMED)."""
    F = JitCheckpoint.F
    best = min(events, key=_decides)
    outcome = str(best.get(F.outcome))
    step = best.get(F.step)
    resume_step = step if outcome == "saved" else _newest_step(ckpts, float(best["t"]))
    deciding = [a for a in best.get(F.answers) or [] if isinstance(a, dict) and a.get(JitAnswer.F.outcome) != "skipped"]
    out = {"outcome": outcome, "step": step, "seconds": best.get(F.seconds), "path": best.get(F.path),
           "reason": best.get(F.reason), "node": best.get("node"),
           "rank": deciding[0].get(JitAnswer.F.rank) if deciding else None, "fault": best.get(F.fault),
           "lost": best.get(F.lost), "t": best["t"], "time": iso(best["t"]),
           "waited_s": max((e.get(F.waited) for e in events if isinstance(e.get(F.waited), (int, float))), default=None),
           "resumed": resumed, "resume_step": resume_step,
           "resume_from": "jit" if outcome == "saved" else "checkpoint",
           "nodes": [_node(e) for e in events if e.get(F.outcome) != "skipped"],
           "nodes_skipped": sum(1 for e in events if e.get(F.outcome) == "skipped")}
    out["text"] = text(out)
    return out


def text(j: dict[str, Any]) -> str:
    """The fault's one line: the step saved and how fast, or why nothing was saved and the step resumed from."""
    verb = "resumed from" if j["resumed"] else "a restart resumes from"
    if j["outcome"] == "saved":
        who = f" by rank {j['rank']}" if j.get("rank") is not None else ""
        return f"just-in-time checkpoint of step {j['step']} saved in {_secs(j.get('seconds'))}{who}; {verb} it"
    why = j.get("reason") or f"outcome {j['outcome']}"
    of = f" of step {j['step']}" if j.get("step") is not None else ""
    step = (f", step {j['resume_step']}" if j.get("resume_step") is not None
            else " (its step unknown: no checkpoint reported complete before it)")
    return f"no just-in-time checkpoint{of} ({why}); {verb} {FALLBACK}{step}"


def level(j: dict[str, Any]) -> str:
    return LEVEL.get(str(j.get("outcome")), "warn")


def _decides(e: dict[str, Any]) -> tuple:
    """Sort key: the deciding node first (saved, failed, skipped; a skip that names a step before one that does
    not, e.g. "nothing newer than the checkpoint of step 800" before "rank 0 saves the replicated state")."""
    return (_ORDER.get(str(e.get(JitCheckpoint.F.outcome)), 1), e.get(JitCheckpoint.F.step) is None, e["t"])


def _newest_step(ckpts: list[tuple[float, Any]], before: float) -> int | None:
    """The highest step of a checkpoint reported complete at or before BEFORE: what resume() loads."""
    steps = [step for t, step in ckpts if t <= before and isinstance(step, int)]
    return max(steps) if steps else None


def _node(e: dict[str, Any]) -> dict[str, Any]:
    """One node's jit_checkpoint as --json lists it: its outcome and each asked rank's answer."""
    F = JitCheckpoint.F
    return {"node": e.get("node"), "outcome": e.get(F.outcome), "step": e.get(F.step), "seconds": e.get(F.seconds),
            "waited_s": e.get(F.waited), "path": e.get(F.path), "reason": e.get(F.reason), "lost": e.get(F.lost),
            "fault": e.get(F.fault), "answers": [a for a in e.get(F.answers) or [] if isinstance(a, dict)]}


def _secs(x: Any) -> str:
    return f"{x:.2f} s" if isinstance(x, (int, float)) else "? s"
