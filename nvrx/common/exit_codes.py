"""Exit codes shared by the agent (`nvrx launch`), the resume driver (`nvrx resume`) and bash loops.

Agent (``nvrx launch``):
  0            every rank exited 0 (the run may still be unfinished: see the finished flag file)
  1            the job failed: a rank failed with no restarts left, or the rendezvous was lost
  2            usage error (bad flag, bad config, port in use...)
  18           shared storage failed its check (full, read-only, too slow, unusable): not this node's fault, so
               `nvrx resume` excludes no node for it
  128+signum   stopped gracefully on a signal (143 = SIGTERM, 138 = SIGUSR1, 140 = SIGUSR2): resume me

Codes a rank may exit with to steer the resume logic; the agent does not restart in place on these
and exits with the same code:
  16   resume, but on different hardware (exclude this node next time)
  17   the result failed validation: stop, do not resume
  93   do not requeue

``nvrx resume`` (its own exit status, for bash):
  0    the run is finished (the finished flag file exists)
  3    continue: launch again / a continuation job was submitted
  4    give up: out of attempts or failures, no progress, or a job asked not to be requeued
"""

from __future__ import annotations

import signal

OK = 0
FAILED = 1
USAGE = 2
SIGNAL_BASE = 128
STORAGE_FAILED = 18  # the agent's own verdict on shared storage (node health check "storage"), never a rank's

RESUME_ELSEWHERE = 16
VALIDATION_FAILED = 17
DO_NOT_REQUEUE = 93
STEERING_MEANINGS = {
    RESUME_ELSEWHERE: "resume on different hardware",
    VALIDATION_FAILED: "failed result validation, stop",
    DO_NOT_REQUEUE: "do not requeue",
}
STEERING_CODES = frozenset(STEERING_MEANINGS)

RESUME_FINISHED = 0
RESUME_CONTINUE = 3
RESUME_GIVE_UP = 4


def interrupted(signum: int) -> int:
    """The agent's exit code after a graceful stop on SIGNUM."""
    return SIGNAL_BASE + int(signum)


def interrupted_signal(code: int) -> signal.Signals | None:
    """The signal an agent exit code reports a graceful stop for, or None."""
    if SIGNAL_BASE < code < SIGNAL_BASE + 65:
        try:
            return signal.Signals(code - SIGNAL_BASE)
        except ValueError:
            return None
    return None
