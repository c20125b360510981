"""A hung test cannot hang the run (a pytest plugin, registered by tests/conftest.py).

pytest-timeout decides how long a test may take (the ``timeout`` ini option in pyproject.toml, ``--timeout N``,
``@pytest.mark.timeout(N)`` on a test that needs longer); this module is what happens when it runs over, through
pytest-timeout's own hooks. From a watchdog thread, when the time is up:

1. every thread's stack of the test process and the tree of its child processes (pid, state, kernel wait
   channel, command line) are written into the test's report (section "timeout");
2. the child processes are killed (SIGKILL), which unblocks a test waiting on one of them;
3. the main thread gets SIGALRM, whose handler fails the test, so its fixtures tear down as usual;
4. a test still running GRACE seconds later (stuck in a C call that never returns to Python) ends the test
   process with the report on stderr: pytest-xdist reports the test as crashed and starts a new worker.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import psutil
import pytest

GRACE = float(os.environ.get("NVRX_TEST_TIMEOUT_GRACE", "30"))  # the suite's own tests of this module shorten it
_WATCHDOG = pytest.StashKey["Watchdog"]()


# Frames of the test runner itself (pytest, pluggy, xdist's worker loop): left out of the dump, they are the same
# for every test and push the test's own frames out of view.
_RUNNER = tuple(f"{os.sep}{name}{os.sep}" for name in ("_pytest", "pluggy", "execnet", "xdist"))


def _format(frame) -> str:
    stack = traceback.extract_stack(frame)
    own = [f for f in stack if not any(part in f.filename for part in _RUNNER)] or stack
    return "".join(traceback.format_list(own))


def thread_stacks() -> str:
    """Every Python thread's stack in this process (without the test runner's frames), the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    out = []
    for ident in sorted(frames, key=lambda i: (i != main, names.get(i, ""))):
        if ident == threading.get_ident():
            continue  # the watchdog itself
        out.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + _format(frames[ident]))
    return "\n".join(out)


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            return fh.read().strip() or "-"
    except OSError:
        return "?"


def process_tree(root: psutil.Process) -> tuple[str, list[psutil.Process]]:
    """ROOT's descendants, one line each (indented by depth), and the processes themselves."""
    lines, procs = [], []

    def walk(proc: psutil.Process, depth: int) -> None:
        try:
            kids = proc.children()
        except psutil.Error:
            return
        for kid in kids:
            try:
                with kid.oneshot():
                    line = (f"{'  ' * depth}{kid.pid} ppid={kid.ppid()} {kid.status()} wchan={_wchan(kid.pid)} "
                            f"threads={kid.num_threads()} {' '.join(kid.cmdline())[:400] or kid.name()}")
            except psutil.Error:
                continue
            lines.append(line)
            procs.append(kid)
            walk(kid, depth + 1)

    walk(root, 0)
    return "\n".join(lines) or "(no child processes)", procs


def kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


class Watchdog:
    """Times one test (setup, call and teardown); see the module docstring for what expiry does."""

    def __init__(self, item: pytest.Item, seconds: float) -> None:
        self.item = item
        self.seconds = seconds
        self.report = ""
        self.fired = False
        self._done = threading.Event()
        self._main = threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGALRM, self._on_alarm) if self._main else None
        self._thread = threading.Thread(target=self._run, name="nvrx-test-timeout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._done.wait(self.seconds):
            return
        self.fired = True
        t0 = time.monotonic()
        tree, procs = process_tree(psutil.Process())
        self.report = (f"{self.item.nodeid} ran over its timeout of {self.seconds:g} s\n\n"
                       f"=== threads of the test process {os.getpid()}\n{thread_stacks()}\n"
                       f"=== its child processes (killed now)\n{tree}\n")
        if self._main:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)
        kill_all(procs)
        if self._done.wait(GRACE + (time.monotonic() - t0)):
            return
        self._exit_process()

    def _on_alarm(self, signum, frame) -> None:
        if self.fired and not self._done.is_set():
            pytest.fail(f"Timeout: over {self.seconds:g} s; thread stacks and the process tree are in the "
                        "'timeout' section", pytrace=False)

    def _exit_process(self) -> None:
        capman = self.item.config.pluginmanager.getplugin("capturemanager")
        try:
            if capman is not None:
                capman.suspend_global_capture(in_=True)
        except Exception:  # the capture state is unknown here; the report matters more
            pass
        msg = (f"\n{'+' * 30} Timeout {'+' * 30}\n{self.report}\n{self.item.nodeid} did not end {GRACE:g} s after its "
               f"child processes were killed; ending the test process {os.getpid()}\n"
               f"=== threads now\n{thread_stacks()}\n")
        os.write(2, msg.encode(errors="replace"))
        os._exit(1)

    def cancel(self) -> None:
        self._done.set()
        self._thread.join()
        if self._main:
            signal.signal(signal.SIGALRM, self._previous or signal.SIG_DFL)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool:
    item.stash[_WATCHDOG] = Watchdog(item, settings.timeout)
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool:
    dog = item.stash.get(_WATCHDOG, None)
    if dog is not None:
        dog.cancel()
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """The first report after expiry fails (also when killing the children let the test finish) and carries
    the stacks and the process tree."""
    outcome = yield
    report = outcome.get_result()
    dog = item.stash.get(_WATCHDOG, None)
    if dog is None or not dog.fired or getattr(item, "_nvrx_timeout_shown", False):
        return
    item._nvrx_timeout_shown = True
    report.sections.append(("timeout", dog.report))
    if report.passed:
        report.outcome = "failed"
        report.longrepr = f"Timeout: over {dog.seconds:g} s (the test finished only once its children were killed)"
