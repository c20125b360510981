"""``CallWrapper.atomic()`` and the termination procedure share one lock (spec: "Wrapped function termination")."""

from __future__ import annotations

import threading
import time

import pytest

from nvrx.launcher.rank.inprocess.call_wrapper import CallWrapper
from nvrx.launcher.rank.inprocess.exceptions import RestartInterrupt
from nvrx.launcher.rank.inprocess.interruption import InterruptGate


@pytest.fixture
def gate():
    gate = InterruptGate()
    gate.install()
    gate.open()
    yield gate
    gate.close()
    gate.uninstall()


def _interrupt_from_another_thread(gate: InterruptGate, aborted: list[str]) -> None:
    """What the monitor thread does on a fault: abort, then raise the restart exception in the main thread."""
    thread = threading.Thread(target=gate.interrupt, args=(lambda: aborted.append("abort"),))
    thread.start()
    thread.join()


def test_atomic_is_refused_once_the_termination_procedure_has_begun(gate):
    call_wrapper = CallWrapper(gate, recorder=None)  # type: ignore[arg-type]
    aborted: list[str] = []
    with pytest.raises(RestartInterrupt):
        _interrupt_from_another_thread(gate, aborted)
        time.sleep(5)  # the interrupt ends this at once (the nudge signal wakes the sleep)
    assert aborted == ["abort"] and gate.raised
    entered = False
    with pytest.raises(RestartInterrupt, match="atomic"):
        with call_wrapper.atomic():
            entered = True
    assert not entered


def test_termination_waits_for_an_atomic_block_to_end(gate):
    call_wrapper = CallWrapper(gate, recorder=None)  # type: ignore[arg-type]
    aborted: list[str] = []
    events: list[str] = []
    with pytest.raises(RestartInterrupt):
        with call_wrapper.atomic():
            thread = threading.Thread(target=gate.interrupt, args=(lambda: aborted.append("abort"),))
            thread.start()
            time.sleep(0.3)  # bytecode runs here, yet nothing is raised while the block is held
            events.append("block done")
            assert aborted == [] and thread.is_alive()
        thread.join()
        time.sleep(5)
    assert events == ["block done"] and aborted == ["abort"]
