"""The monitor's part in a just-in-time checkpoint: relay the agent's "save now" to the rank, and the answer back.

A rank that can save on failure (``nvrx.ckpt.jit``) keeps a second connection to its monitor open, parked in
``jit_wait``: the monitor does not answer it until the agent asks. When a peer dies, the agent connects with the
monitor token and sends ``jit_request``; the monitor writes the request to the parked connection (the rank's JIT
thread wakes on it even while the rank's main thread is blocked in a collective) and answers the agent only when
the rank sends ``jit_result`` on that connection, or at once when no rank is parked (nothing to save here), or
when the parked connection closes under the request (the rank died while saving).

A rank whose collective failed because a peer is gone sends ``jit_peer_failed`` {error} on its parked connection
before it waits: the monitor passes it to the agent as a workload request with action :data:`PEER_FAILED` (the
agent ends the round on it when no other node has within a moment: a lost node's agent reports nothing).

Pure bookkeeping over the monitor's connections; the monitor's event loop owns the sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

PEER_FAILED = "PeerFailed"  # the action of the monitor -> agent line for ``jit_peer_failed`` (not a user's action)


@dataclass
class JitRelay:
    """Which connection is parked by the rank's JIT thread, and which agent connection waits for its answer."""

    waiter: Any = None  # the rank's parked connection (a monitor Conn)
    waiter_pid: int | None = None
    asker: Any = None  # the agent's connection waiting for the answer

    def park(self, conn: Any, pid: int) -> None:
        """The rank's JIT thread waits on CONN (a newer park of the same rank replaces an older one)."""
        self.waiter, self.waiter_pid = conn, pid

    def ask(self, conn: Any, request: dict[str, Any], send: Callable[[Any, dict[str, Any]], None]) -> dict[str, Any] | None:
        """The agent asks for a save: pass it to the parked rank (the answer comes later: None), or answer now."""
        if self.waiter is None:
            return {"relayed": False, "saved": False, "error": "no JIT saver is waiting in this rank"}
        if self.asker is not None:
            return {"relayed": False, "saved": False, "error": "a JIT save is already under way in this rank"}
        self.asker = conn
        send(self.waiter, {"op": "jit_save", **request})
        return None

    def answer(self, conn: Any, result: dict[str, Any], send: Callable[[Any, dict[str, Any]], None]) -> bool:
        """The rank's JIT thread answered on CONN: pass it to the waiting agent (False: nobody asked on CONN)."""
        if conn is not self.waiter or self.asker is None:
            return False
        asker, self.asker = self.asker, None
        self.waiter, self.waiter_pid = None, None  # one save per rank process: it parks again if it wants
        send(asker, {"ok": True, "relayed": True, **result})
        return True

    def dropped(self, conn: Any, send: Callable[[Any, dict[str, Any]], None]) -> None:
        """CONN closed: a parked rank that died under a request is answered for; a gone agent is forgotten."""
        if conn is self.asker:
            self.asker = None
        if conn is self.waiter:
            self.waiter, self.waiter_pid = None, None
            if self.asker is not None:
                asker, self.asker = self.asker, None
                send(asker, {"ok": True, "relayed": True, "saved": False,
                             "error": "the rank's JIT saver went away during the save (the rank died?)"})
