"""The rank's end of a just-in-time checkpoint request: a thread parked on the rank monitor (``nvrx.ckpt.jit``).

Started by the bootstrap under ``nvrx launch --jit-ckpt`` once the rank is attached to its monitor. It opens
a second connection to the monitor (the token proves it is the rank) and sends ``jit_wait``; the monitor
answers only when the agent asks for a save. Then this thread, not the main one (blocked in a collective
waiting for the dead peer, as a rank almost always is at that moment), saves with the checkpointer that
registered itself, and sends the result back on the same connection. If the monitor is restarted, the thread
parks again on the new one.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nvrx.monitors.control import LineBuffer, encode

log = logging.getLogger("nvrx.jit_link")

RECONNECT_FOR = 60.0  # seconds to wait for a restarted monitor before this rank stops listening
# Words of the errors a collective raises when a peer process died (gloo: its TCP connection closed; NCCL: the
# remote process or the store is gone). A rank failing with one of them waits for the agent's JIT request.
PEER_FAILURE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker",
                        "remote process", "socket timeout", "connection refused")

_parked = threading.Event()  # a thread waits on the monitor: the agent can ask this rank for a save
_served = threading.Event()  # ... and it has answered (or given up)
# the parked connection ("sock") and, once a request arrived, its deadline ("deadline": the exit waits for the save)
_link: dict[str, Any] = {}


def start(socket_path: Path, token: str, rank: int) -> threading.Thread:
    """Park a daemon thread on the monitor at SOCKET_PATH for this RANK's JIT requests."""
    thread = threading.Thread(target=_serve, args=(Path(socket_path), token, rank), name="nvrx-jit-link", daemon=True)
    thread.start()
    return thread


def _serve(path: Path, token: str, rank: int) -> None:
    deadline = time.monotonic() + RECONNECT_FOR
    while time.monotonic() < deadline:
        try:
            if _park_once(path, token, rank):
                return  # one JIT save per rank process: the agent stops the rank after it
            deadline = time.monotonic() + RECONNECT_FOR  # the monitor went away: give its successor time
        except OSError as exc:
            log.debug("cannot park on the rank monitor for JIT requests: %s", exc)
        time.sleep(0.2)
    log.warning("no rank monitor to wait on for just-in-time checkpoint requests: this rank will not save on failure")


def _park_once(path: Path, token: str, rank: int) -> bool:
    """Wait on one connection; True after a request was served, False when the monitor closed it first."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        sock.sendall(encode({"op": "jit_wait", "token": token, "pid": os.getpid()}))
        _link["sock"] = sock
        _parked.set()
        lines = LineBuffer()
        while True:
            data = sock.recv(65536)
            if not data:
                return False
            for msg in lines.feed(data):
                if isinstance(msg, dict) and msg.get("op") == "jit_save":
                    _link["deadline"] = _deadline(msg)
                    try:
                        result = _save(msg, rank)
                        sock.sendall(encode({"op": "jit_result", **result}))
                        sock.settimeout(1.0)
                        sock.recv(4096)  # the monitor's acknowledgement (it passed the result to the agent)
                    finally:
                        _served.set()
                    return True
                if isinstance(msg, dict) and not msg.get("ok", True):
                    log.warning("the rank monitor refused to relay JIT requests: %s", msg.get("error"))
                    return True
    finally:
        _link.pop("sock", None)
        sock.close()


def _deadline(request: dict[str, Any]) -> float:
    deadline = request.get("deadline")
    return float(deadline) if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) else time.monotonic()


def peer_failure(exc: BaseException) -> bool:
    """EXC is what a collective raises when a peer died (not this rank's own failure)."""
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    text = str(exc).lower()
    return (dist_error is not None and isinstance(exc, dist_error)) or any(m in text for m in PEER_FAILURE_MARKERS)


def hold_exit(exc: BaseException, timeout: float) -> bool:
    """The rank is about to exit with EXC: if a peer's death caused it, wait (up to TIMEOUT s, or the deadline of
    a save under way) for the agent's JIT request and its save, so the survivor is still there to save. True if
    a request was served.

    gloo raises at once in the survivors when a peer's process dies (its connection closes). When the peer's
    node is gone with its agent, nobody else reports the death soon (its keepalive expires seconds later), so
    this rank tells its monitor first (``jit_peer_failed``, passed on to the agent, which ends the round on it);
    a rank failing for its own reason exits at once.
    """
    if not _parked.is_set() or _served.is_set() or not peer_failure(exc):
        return _served.is_set()
    first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    log.info("a peer failed (%s): waiting up to %.1f s for the agent's just-in-time checkpoint request", first, timeout)
    _tell_monitor(first)
    if _served.wait(timeout) or "deadline" not in _link:
        return _served.is_set()
    return _served.wait(max(0.0, _link["deadline"] + 1.0 - time.monotonic()))


def _tell_monitor(error: str) -> None:
    """Say on the parked connection that a collective failed because a peer is gone (best effort)."""
    sock = _link.get("sock")
    if sock is None:
        return
    try:
        sock.sendall(encode({"op": "jit_peer_failed", "error": error}))
    except OSError as exc:
        log.debug("cannot tell the rank monitor that a peer failed: %s", exc)


def _save(request: dict[str, Any], rank: int) -> dict[str, Any]:
    from nvrx.ckpt import jit

    try:
        return jit.serve(request, rank)
    except Exception as exc:  # noqa: BLE001 - the agent goes on as without JIT
        return {"saved": False, "error": f"{type(exc).__name__}: {exc}"}
