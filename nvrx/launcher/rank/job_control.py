"""What training code calls to cooperate with nvrx: stop gracefully, mark the run finished.

Graceful stop. When Slurm (preemption, ``scancel --signal=TERM``, ``--signal=TERM@120``) or a site's
``SIGUSR1``/``SIGUSR2`` warning reaches an agent, the agent passes the signal to its ranks once and
tells the other nodes to do the same. A rank that calls :func:`should_stop` turns those signals into
a flag instead of dying, and the ranks agree on one step to stop at through the job's store: the first
rank to see the signal proposes ``its step + 2`` with a compare-and-set (the first proposal wins) and a
watcher thread in every rank learns the agreed step. Lockstep training keeps ranks within one step of
each other, so every rank stops at the same step and can save a checkpoint::

    for step in range(start, total):
        train_step()
        if job_control.should_stop(step):
            save_checkpoint(step)
            break
    else:
        job_control.mark_finished()

Ranks that never call :func:`should_stop` keep the default action of the signal. After the grace
period (``nvrx launch --term-timeout``) the agent kills what is left.

Finished flag. :func:`mark_finished` creates the file named by ``FAULT_TOL_FINISHED_FLAG_FILE`` (set
by ``nvrx resume`` or the sbatch script, inherited by every rank); its presence ends an auto-resume chain.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Mapping

from nvrx.common.files import atomic_write

log = logging.getLogger("nvrx.job_control")

FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"
GRACEFUL_SIGNALS_ENV = "NVRX_GRACEFUL_SIGNALS"  # set by the agent: e.g. "SIGTERM,SIGUSR1,SIGUSR2"
DEFAULT_GRACEFUL_SIGNALS = "SIGTERM"
STOP_KEY = "nvrx/graceful_stop/step"
STOP_MARGIN = 2  # steps between the first rank seeing the signal and the agreed stop step


# ---------------------------------------------------------------- finished flag


def finished_flag_file() -> Path | None:
    """The finished flag file of this run, if one was configured."""
    value = os.environ.get(FINISHED_FLAG_ENV)
    return Path(value) if value else None


def mark_finished() -> Path:
    """Record that training is complete, so no further attempt or job is started.

    Safe for every rank of every node to call, at once and more than once (the flag ends up the same): each call
    writes its own temporary file, named by host, pid and a random part (two nodes of a job on a shared file
    system may have the same pid), and renames it over the flag. The file and its directory are fsynced before
    this returns: a crash right after cannot lose the flag that ends the resume chain.
    """
    path = finished_flag_file()
    if path is None:
        raise RuntimeError(f"{FINISHED_FLAG_ENV} is not set: run under `nvrx resume` or export it in the sbatch script")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, f"finished host={socket.gethostname()} pid={os.getpid()}\n".encode(), mode=0o644)
    return path


def is_finished() -> bool:
    """True once some rank (of this or an earlier job) called mark_finished()."""
    path = finished_flag_file()
    return path is not None and path.exists()


# ---------------------------------------------------------------- graceful stop


def _graceful_signals(env: Mapping[str, str]) -> list[signal.Signals]:
    names = (env.get(GRACEFUL_SIGNALS_ENV) or DEFAULT_GRACEFUL_SIGNALS).split(",")
    found = []
    for name in names:
        try:
            found.append(signal.Signals[name.strip().upper()])
        except KeyError:
            log.warning("ignoring unknown signal %r in %s", name, GRACEFUL_SIGNALS_ENV)
    return found


class StopAgreement:
    """One rank's view of the graceful stop: the local signal flag and the step all ranks agreed on."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.signal_received: signal.Signals | None = None
        self.stop_step: int | None = None
        self._calls = 0
        self._proposed = False
        self._store_addr = (env.get("MASTER_ADDR"), env.get("MASTER_PORT"))
        self._store: Any = None
        self._lock = threading.Lock()
        for sig in _graceful_signals(env):
            signal.signal(sig, self._on_signal)
        if all(self._store_addr):
            threading.Thread(target=self._watch, name="nvrx-stop-watch", daemon=True).start()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.signal_received is None:
            self.signal_received = signal.Signals(signum)
            log.info("%s received: this rank will stop at the step all ranks agree on", self.signal_received.name)

    def _connect(self) -> Any:
        import torch.distributed as dist

        host, port = self._store_addr
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))

    def _watch(self) -> None:
        """Learn the agreed step as soon as any rank proposes one (its own connection: wait blocks)."""
        try:
            store = self._connect()
            while self.stop_step is None:
                try:
                    store.wait([STOP_KEY], datetime.timedelta(hours=24))
                except RuntimeError:  # wait timed out: keep waiting
                    continue
                self._adopt(int(store.get(STOP_KEY)))
        except Exception as exc:  # the store went away: the round is over anyway
            log.debug("stop watcher ended: %s", exc)

    def _adopt(self, step: int) -> None:
        with self._lock:
            if self.stop_step is None:
                self.stop_step = step

    def _propose(self, step: int) -> None:
        self._proposed = True
        if not all(self._store_addr):
            self._adopt(step)  # a single process: nobody to agree with
            return
        try:
            if self._store is None:
                self._store = self._connect()
            agreed = self._store.compare_set(STOP_KEY, "", str(step))
            self._adopt(int(agreed))
        except Exception as exc:
            log.warning("cannot agree on a stop step through the store (%s); stopping at step %d", exc, step)
            self._adopt(step)

    def should_stop(self, step: int | None = None) -> bool:
        if step is None:
            step = self._calls
        self._calls += 1
        if self.stop_step is None and self.signal_received is not None and not self._proposed:
            self._propose(step + STOP_MARGIN)
        return self.stop_step is not None and step >= self.stop_step


_agreement: StopAgreement | None = None


def install() -> StopAgreement:
    """Take over the graceful-stop signals now (idempotent; main thread only).

    Until this (or the first :func:`should_stop`) runs, a stop signal has its default action: a signal
    during a long setup (loading data, building the model) would kill the rank instead of being reported.
    Call it early, e.g. right after the imports, and the first should_stop() reports a signal that came
    in between.
    """
    global _agreement
    if _agreement is None:
        _agreement = StopAgreement(os.environ)
    return _agreement


def should_stop(step: int | None = None) -> bool:
    """True when the job is being stopped gracefully and STEP is the agreed step (same on every rank).

    Call it once per training step, from the main thread, with the step number (or with no argument:
    calls are counted). The first call installs the signal handlers if :func:`install` did not already.
    """
    return install().should_stop(step)


def stop_signal() -> signal.Signals | None:
    """The graceful-stop signal this rank received, if any (e.g. to log why training ended)."""
    return _agreement.signal_received if _agreement is not None else None
