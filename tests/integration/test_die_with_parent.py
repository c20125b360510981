"""``nvrx.common.process.die_with_parent``: a child ends when its parent does, whichever came first.

Each case runs a small harness process that is a child subreaper (PR_SET_CHILD_SUBREAPER): it forks
a "parent", which starts the "child" under test; the harness SIGKILLs the parent once the child says
it is ready, and, the orphaned child having been re-parented to the harness, waits for it and
reports its exit status. No sleeps: every step waits on a pipe or on waitpid. A child that does not
die blocks on a pipe held only by the harness, so the test fails (harness timeout) instead of leaking.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIG = signal.SIGUSR1  # not the parent's SIGKILL: the child must get the signal it asked for

HARNESS = r'''
import ctypes, functools, json, os, signal, subprocess, sys
from nvrx.common.process import die_with_parent

SIG = signal.SIGUSR1
PR_SET_CHILD_SUBREAPER = 36


def child_after_fork(parent, case, hold_r, ready_w):
    if case == "parent_already_gone":
        gone_r = int(os.environ["GONE_R"])
        os.write(ready_w, b"%d\n" % os.getpid())
        os.read(gone_r, 1)  # EOF: the parent, the only holder of the write end, is exiting
        while os.getppid() == parent:  # its files close before we are re-parented: wait for the re-parenting
            os.sched_yield()
        die_with_parent(parent, SIG)
        os._exit(0)  # only if die_with_parent did not end us
    die_with_parent(parent, SIG)
    os.write(ready_w, b"%d\n" % os.getpid())
    os.read(hold_r, 1)  # blocks until the death signal (or EOF if the harness dies)
    os._exit(0)


def parent(case, hold_r, hold_w, ready_w):
    os.close(hold_w)
    me = os.getpid()
    if case == "preexec_fn":
        code = "import os, sys; os.write(int(sys.argv[1]), b'%d\\n' % os.getpid()); os.read(int(sys.argv[2]), 1)"
        subprocess.Popen([sys.executable, "-c", code, str(ready_w), str(hold_r)], pass_fds=(ready_w, hold_r),
                         preexec_fn=functools.partial(die_with_parent, me, SIG))
    else:
        gone_r, gone_w = os.pipe()
        os.environ["GONE_R"] = str(gone_r)
        if os.fork() == 0:
            os.close(gone_w)
            child_after_fork(me, case, hold_r, ready_w)
        os.close(gone_r)
    os.read(hold_r, 1)  # stay alive until killed
    os._exit(0)


def main(case):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")
    signal.signal(SIG, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {SIG})
    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(ready_r)
        parent(case, hold_r, hold_w, ready_w)
    os.close(ready_w)
    os.close(hold_r)
    with os.fdopen(ready_r) as ready:
        child = int(ready.readline())
    os.kill(middle, signal.SIGKILL)
    _, parent_status = os.waitpid(middle, 0)
    _, status = os.waitpid(child, 0)  # re-parented to us, the subreaper
    print(json.dumps({"parent": os.waitstatus_to_exitcode(parent_status), "child": os.waitstatus_to_exitcode(status)}))


main(sys.argv[1])
'''


def run_case(case: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", HARNESS, case], capture_output=True, text=True, env=env,
                         timeout=60)  # a safety net against a child that never dies, not a measurement
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("case", ["forked_child", "preexec_fn"])
def test_the_child_gets_the_signal_when_its_parent_is_killed(case):
    codes = run_case(case)
    assert codes["parent"] == -signal.SIGKILL
    assert codes["child"] == -SIG


def test_a_child_whose_parent_is_already_gone_exits_at_once_with_128_plus_sig():
    codes = run_case("parent_already_gone")
    assert codes["parent"] == -signal.SIGKILL
    assert codes["child"] == 128 + SIG
