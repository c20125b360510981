"""The agent's side of a just-in-time checkpoint: ask the surviving local ranks, through their monitors, to save.

Called once per failed round, after the stop record and before the survivors are stopped. Each local rank's
monitor gets ``jit_request`` (the lost ranks, the world size, the deadline as a CLOCK_MONOTONIC time, which
ranks of this node share with the agent) and answers when its rank has saved, skipped or failed
(``nvrx.monitors.jit_relay``). Everything is bounded by the deadline plus a short grace: a JIT save can only
win time; past the bound the job restarts as it would without it. ``outcome`` turns the answers into this node's
outcome (saved / skipped / failed): the agent's log line and its ``jit_checkpoint`` event, which `nvrx inspect`
merges over the nodes into one outcome per fault (``nvrx.inspection.jit_outcome``).
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GRACE = 1.0  # seconds past the deadline for an answer already on its way (the rank publishes only before it)


def lost_ranks(kind: str, detail: Any, nproc: int) -> list[int]:
    """The global ranks a stop record's DETAIL (a ``StopDetail``, or its dict) says are gone: the failed rank,
    or every rank of the node that left."""
    def field(name: str) -> Any:
        return detail.get(name) if isinstance(detail, dict) else getattr(detail, name, None)

    if field("rank") is not None:
        return [int(field("rank"))]
    if kind == "node_left" and field("group_rank") is not None:
        first = int(field("group_rank")) * nproc
        return list(range(first, first + nproc))
    return []


def request_saves(targets: list[tuple[int, Path, str]], request: dict[str, Any], timeout: float) -> dict[int, dict[str, Any]]:
    """Send REQUEST to each (local rank, monitor socket, token) of TARGETS; their answers by local rank.

    A monitor that cannot be reached or does not answer in time is reported as such (``saved`` False).
    """
    deadline = time.monotonic() + timeout
    request = {**request, "deadline": deadline}
    sel = selectors.DefaultSelector()
    answers: dict[int, dict[str, Any]] = {}
    buffers: dict[int, bytes] = {}
    for lr, path, token in targets:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(min(1.0, timeout))
            sock.connect(str(path))
            sock.sendall(json.dumps({"op": "jit_request", "token": token, **request}).encode() + b"\n")
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            answers[lr] = {"saved": False, "error": f"cannot reach the rank monitor: {exc}"}
            continue
        sel.register(sock, selectors.EVENT_READ, lr)
        buffers[lr] = b""
    try:
        while sel.get_map():
            left = deadline + GRACE - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                lr = key.data
                try:
                    chunk = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                buffers[lr] += chunk
                if chunk and b"\n" not in buffers[lr]:
                    continue
                answers[lr] = _answer(buffers[lr])
                sel.unregister(key.fileobj)
                key.fileobj.close()
    finally:
        for key in list(sel.get_map().values()):
            answers.setdefault(key.data, {"saved": False, "error": f"no answer within {timeout:g} s: abandoned"})
            key.fileobj.close()
        sel.close()
    return answers


def _answer(raw: bytes) -> dict[str, Any]:
    line = raw.split(b"\n", 1)[0]
    if not line:
        return {"saved": False, "error": "the rank monitor closed the connection"}
    try:
        msg = json.loads(line)
    except ValueError:
        return {"saved": False, "error": "unreadable answer from the rank monitor"}
    if not isinstance(msg, dict) or not msg.get("ok"):
        return {"saved": False, "error": str(msg.get("error") if isinstance(msg, dict) else msg)}
    return msg


def classify(answer: dict[str, Any]) -> tuple[str, str | None]:
    """(outcome, reason) of one rank's answer: saved; failed (it tried and failed, had no saver waiting, could not
    be asked or did not answer in time); skipped (it left the save to another rank, or had nothing newer)."""
    if answer.get("saved"):
        return "saved", None
    if answer.get("error"):
        return "failed", str(answer["error"])
    return "skipped", str(answer.get("skipped") or "") or None


@dataclass
class Outcome:
    """This node's just-in-time checkpoint in one word and its details: what the agent logs and records.

    LINE is the agent's log line; ANSWERS each asked local rank's (local rank, outcome, reason).
    """

    outcome: str                          # saved | skipped | failed
    line: str
    step: int | None = None
    seconds: float | None = None
    path: str | None = None
    reason: str | None = None
    answers: list[tuple[int, str, str | None]] = field(default_factory=list)

    @property
    def saved(self) -> bool:
        return self.outcome == "saved"


def outcome(answers: dict[int, dict[str, Any]]) -> Outcome:
    """The node's outcome from its ranks' ANSWERS (by local rank), with one line for the agent's log.

    A rank that saved wins; then a rank that tried and failed (its reason); then one that left the save to a
    rank of another node (skipped); a rank that could not be reached or had no saver waiting comes last. No rank to
    ask (every local rank was lost) is skipped too: the save is another node's to make.
    """
    per_rank = [(lr, *classify(a)) for lr, a in sorted(answers.items())]
    saved = [a for a in answers.values() if a.get("saved")]
    if saved:
        a = saved[0]
        return Outcome("saved", f"just-in-time checkpoint of step {a.get('step')} saved in {a.get('seconds')} s: "
                                f"{a.get('path')}", step=_int(a.get("step")), seconds=_float(a.get("seconds")),
                       path=str(a.get("path")) if a.get("path") else None, answers=per_rank)
    failed = next((a for a in answers.values() if a.get("error") and a.get("relayed", True)), None)
    skipped = next((a for a in answers.values() if a.get("skipped")), None)
    if failed is None and skipped is not None:
        why = str(skipped["skipped"])
        return Outcome("skipped", f"no just-in-time checkpoint from this node: {why}", step=_int(skipped.get("step")),
                       reason=why, answers=per_rank)
    chosen = failed or next((a for a in answers.values() if a.get("error")), None)
    why = str(chosen["error"]) if chosen is not None else "no surviving local rank to ask"
    line = f"no just-in-time checkpoint ({why}); the restart resumes from the newest periodic/local checkpoint"
    if chosen is None:
        return Outcome("skipped", line, reason=why, answers=per_rank)
    return Outcome("failed", line, step=_int(chosen.get("step")), reason=why, answers=per_rank)


def skipped(why: str) -> Outcome:
    """This node asks none of its ranks, for the reason WHY."""
    return Outcome("skipped", f"no just-in-time checkpoint from this node: {why}", reason=why)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
