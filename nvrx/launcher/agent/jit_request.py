"""The agent's side of a just-in-time checkpoint: ask the surviving local ranks, through their monitors, to save.

Called once per failed round, after the stop record and before the survivors are stopped. Each local rank's
monitor gets ``jit_request`` (the lost ranks, the world size, the deadline as a CLOCK_MONOTONIC time, which
ranks of this node share with the agent) and answers when its rank has saved, skipped or failed
(``nvrx.monitors.jit_relay``). Everything is bounded by the deadline plus a short grace: a JIT save can only
win time; past the bound the job restarts as it would without it.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import time
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


def summary(answers: dict[int, dict[str, Any]]) -> tuple[bool, str]:
    """(saved, one line) for the agent's log: which rank saved which step, or why nothing was saved.

    A rank that saved wins; then a rank that tried and failed (its reason); then one that left the save to a
    rank of another node; last a rank with nothing registered to save.
    """
    def first(pred: Any, key: str) -> str | None:
        return next((str(a[key]) for a in answers.values() if pred(a) and a.get(key)), None)

    saved = [a for a in answers.values() if a.get("saved")]
    if saved:
        a = saved[0]
        return True, f"just-in-time checkpoint of step {a.get('step')} saved in {a.get('seconds')} s: {a.get('path')}"
    why = first(lambda a: a.get("relayed", True), "error")
    if why is None and first(lambda a: True, "skipped") is not None:
        return False, f"no just-in-time checkpoint from this node: {first(lambda a: True, 'skipped')}"
    why = why or first(lambda a: True, "error") or "no surviving local rank to ask"
    return False, f"no just-in-time checkpoint ({why}); the restart resumes from the newest periodic/local checkpoint"
