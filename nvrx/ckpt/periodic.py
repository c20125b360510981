"""Checkpoint every N steps or T seconds with one call per training step, and resume from the newest on start.

Frequent checkpoints are what makes a restart cheap (little to recompute), but wiring asynchronous saves by
hand (when to save, when to publish, what to load on start, never two saves piling up) is where users stop.
This is the whole loop::

    from nvrx import ckpt
    saver = ckpt.PeriodicCheckpointer("ckpts", model=model, optimizer=opt, every_steps=10)
    start = saver.resume()                       # steps already done (0 on a fresh start); model and optimizer loaded
    for step in range(start, total):
        train_step(step)
        saver.step(step)                         # saves when due (blocks only for the copy), publishes in the background
    saver.close()                                # every pending save published, writer stopped

Every rank runs the same calls. Saves go through ``AsyncCheckpointer`` (DCP format; the writer process is the
one ``nvrx launch --async-ckpt`` started with the rank). A checkpoint is named ``step_<steps done>``; the newest
complete one is what ``resume`` loads, and ``keep_last`` older ones are kept next to it.

Planning a save, publishing it (agreeing that every rank's files are durable, the metadata, fsyncs, the
rename) costs tens of milliseconds; done by the training thread every few steps it would cost percents of
the run. So all of it runs on one long-lived background thread, with its collectives on a process group of
its own (training's collectives on the default group go on meanwhile), and only one save is in flight at a
time: the training thread touches the checkpointer only while that thread is idle. Whether every rank's
thread is idle is asked one step ahead (an all-reduce that is answered by the time the save falls due).

On the training thread a save is only a copy into reused staging memory (``nvrx.ckpt.snapshot``), and with
COPY_IN_BACKGROUND (the default) not even all of it: the parameters and the optimizer's state are copied by
the background thread, and the next ``optimizer.step()`` waits until that copy is done (a step pre-hook), so
the checkpoint holds the values of the save call. Buffers and STATE are copied at once. Code that changes
parameters in place outside the optimizer between ``step()`` and the next ``optimizer.step()`` must call
``wait_copied()`` first (or pass ``copy_in_background=False``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from nvrx.ckpt.api import AsyncCheckpointer
from nvrx.ckpt.errors import CheckpointError
from nvrx.ckpt.interval import WindowMedian
from nvrx.ckpt.loader import find_latest_checkpoint, max_over_ranks
from nvrx.ckpt.snapshot import capturable, capture
from nvrx.common.files import private_dir

log = logging.getLogger("nvrx.ckpt.periodic")

_SLICE = 0.2  # seconds: the training thread never blocks in one C call longer (hang detection sees it alive)
STEP_KEY = "nvrx_steps_done"  # saved with every checkpoint: how many steps the state holds


class PeriodicCheckpointer:
    """Asynchronous checkpoints of MODEL / OPTIMIZER (and an optional STATE dict) at a fixed pace.

    EVERY_STEPS: save after every N steps; "auto": the interval that maximises expected goodput, chosen at each save
    from the measured save cost, step time and drain time and the failure rate seen (``nvrx.ckpt.interval``; the
    job's restarts across continuations are kept in ``ROOT/nvrx_interval.json`` with the choice and why), or
    MTBF_S (the job's configured mean time between failures) while none was seen (with neither, the time the job
    has run so far, a lower bound of its MTBF: the interval grows with it). EVERY_SECONDS: save once T seconds passed since the last save (the
    ranks agree through one small all-reduce per step, so their clocks need not match). Either or both.
    At most one save is in flight: a save that falls due while the previous one is still being written waits
    for the first step after it was published (training is never blocked for the write).
    STATE: more values to save and restore (tensors are loaded in place, other values replaced in the dict).
    KEEP_LAST, PROCESS_GROUP, FILES_PER_RANK: as ``AsyncCheckpointer``; CHECKPOINTER: use this one instead.
    VERIFY: how ``resume`` checks a checkpoint before loading it ("full": checksums, "sizes", None).
    BACKGROUND: publish saves on a background thread (needs an initialised process group; the constructor is then
    collective, it creates a gloo group for the checkpoint's own collectives). False: ``step`` publishes inline.
    COPY_IN_BACKGROUND: leave the copy of parameters and optimizer state to that thread (see above).
    ``copy_wait_seconds``: how long optimizer steps waited for such copies.
    SAVE_ON_FAILURE: under ``nvrx launch --jit-ckpt``, when another rank fails, the lowest surviving rank saves
    the state of the last completed optimizer step as ``jit_step_<steps done>`` before the job restarts
    (``nvrx.ckpt.jit``). It declares MODEL / OPTIMIZER replicated on every rank of the group (DDP); sharded
    state is detected and falls back to the newest periodic checkpoint. Needs ``step`` once per optimizer step.
    STATE values are saved as they are at that moment.
    """

    def __init__(self, root: str | os.PathLike, *, model: Any = None, optimizer: Any = None,
                 state: dict[str, Any] | None = None, every_steps: int | str | None = None,
                 every_seconds: float | None = None, keep_last: int | None = 2, process_group: Any = None,
                 files_per_rank: int = 1, checkpointer: AsyncCheckpointer | None = None, mtbf_s: float | None = None,
                 verify: str | None = "full", background: bool = True, copy_in_background: bool = True,
                 save_on_failure: bool = False) -> None:
        if every_steps is None and every_seconds is None:
            raise ValueError("give every_steps, every_seconds or both")
        self._auto = every_steps == "auto"
        if self._auto:
            every_steps = AUTO_FIRST_STEPS
        elif every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be >= 1 (an int, or \"auto\"), not {every_steps!r}")
        if mtbf_s is not None and not mtbf_s > 0:
            raise ValueError(f"mtbf_s must be > 0 seconds, not {mtbf_s}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, not {every_seconds}")
        if model is None and optimizer is not None:
            raise ValueError("an optimizer is saved with its model: give model= too")
        if model is None and state is None:
            raise ValueError("nothing to save: give model= (and optimizer=) and/or state=")
        self.root = Path(os.path.abspath(root))
        self.model, self.optimizer, self.state = model, optimizer, state
        self.every_steps, self.every_seconds, self.verify = every_steps, every_seconds, verify
        self.process_group = process_group  # where the ranks agree on when to save (the training thread's group)
        self._finalizer: _Finalizer | None = None
        if checkpointer is None:
            group = process_group
            if background and _distributed():
                group = _own_group(process_group)
            # (it reserves staging for its exact state at its first step: no estimate after the optimizer's)
            checkpointer = AsyncCheckpointer(process_group=group, keep_last=keep_last, files_per_rank=files_per_rank,
                                             reserve_after_first_step=False)
            if background and _distributed():
                self._finalizer = _Finalizer(checkpointer)
        self.checkpointer = checkpointer
        self.last_saved: int | None = None  # steps done in the newest save started (or resumed from)
        self._last_save_time = time.monotonic()
        self._due = False  # a save fell due and waits for the previous one to be published
        self._done = 0  # steps done at the last step() call
        self._prepared = False
        self._ahead: tuple[Any, Any] | None = None  # an all-reduce under way: is any rank publishing?
        self._copied = threading.Event()  # set: no copy of the parameters / optimizer state is under way
        self._copied.set()
        self.copy_wait_seconds = 0.0  # time optimizer steps waited for a copy made in the background
        self._overlap = bool(copy_in_background and self._finalizer is not None and optimizer is not None)
        if self._overlap:
            optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._jit = self._arm_jit(keep_last) if save_on_failure else None
        self.mtbf_s = mtbf_s  # configured mean time between failures of the job (every_steps="auto")
        self.interval: Any = None  # the last nvrx.ckpt.interval.Choice (every_steps="auto")
        # for "auto": step time medians (no save draining / one draining; taken from _step_windows when choosing),
        # the blocking part of a save (a moving average), the last drain
        self._measured = {"step_s": None, "drain_step_s": None, "save_s": None, "drain_s": 0.0}
        self._step_windows = {"step_s": WindowMedian(), "drain_step_s": WindowMedian()} if self._auto else {}
        self._drain_carried = False  # the job's earlier round measured the drain's slowdown (nvrx_interval.json)
        self._draining = False  # a save was draining when the step under way began
        self._reported_every: int | None = None  # the interval last reported to the monitor (nvrx inspect)
        self._last_step_at: float | None = None
        self._marker = (0, 0)  # (steps done at the last step() call or resume, the gate's optimizer steps then)

    # ------------------------------------------------------------------ save on failure

    def _arm_jit(self, keep_last: int | None) -> Any:
        """Register the just-in-time checkpoint of this state (only under `nvrx launch --jit-ckpt`)."""
        from nvrx.ckpt import jit

        if self.optimizer is None or self.model is None:
            raise ValueError("save_on_failure needs model= and optimizer= (it saves the last completed optimizer step)")
        if not jit.enabled():
            log.info("save_on_failure=True has no effect without `nvrx launch --jit-ckpt`")
            return None
        saver = jit.JitCheckpointer(self.root, self.optimizer, self._jit_state, self._jit_steps,
                                    self._newest_steps, keep_last=keep_last, step_key=STEP_KEY)
        jit.register(saver)
        return saver

    def _jit_state(self) -> dict[str, Any]:
        """The state dict, built on the JIT thread: never by initialising an optimizer that has not stepped."""
        if not self._optimizer_ready():
            raise CheckpointError("the optimizer has not stepped yet: no state to save")
        return self._state_dict()

    def _jit_steps(self, gate_steps: int) -> int | str:
        """The steps done that the model and optimizer hold now, from the optimizer steps since the last ``step``."""
        done, at = self._marker
        if gate_steps - at in (0, 1):  # (1: the optimizer stepped, step() for that step was not called yet)
            return done + gate_steps - at
        return (f"the optimizer stepped {gate_steps - at} times since the last PeriodicCheckpointer.step() call: "
                "cannot tell which step the state holds (call step() once per optimizer step)")

    def _newest_steps(self) -> int | None:
        """Steps held by the newest published checkpoint under ROOT, from its name (None: none)."""
        from nvrx.ckpt import jit

        newest = find_latest_checkpoint(self.root, verify=None)
        if newest is None:
            return None
        digits = newest.path.name.removeprefix(jit.NAME_PREFIX).removeprefix("step_")
        return int(digits) if digits.isdigit() else None

    # ------------------------------------------------------------------ resume

    def resume(self) -> int:
        """Load the newest complete checkpoint under ROOT; returns the steps it holds (0: none, nothing touched).

        Collective. Unfinished checkpoints of crashed saves are removed (see ``AsyncCheckpointer.sweep``).
        """
        # 0700 whatever the umask (only the directories made here): a root the group can write is refused when
        # loading (nvrx.ckpt.loader.check_private), so under umask 002 a job could not resume from its own saves
        private_dir(self.root)
        if self._auto:
            _record_start(self.root)
            # the measurements of the job's earlier rounds, until this round's own replace them: a restarted
            # round would otherwise choose from a few steps and no save (drain 0: an interval of 1 step)
            history = _interval_history(self.root)
            for key, value in (history.get("measured") or {}).items():
                if key in self._measured and isinstance(value, (int, float)) and value >= 0:
                    self._measured[key] = float(value)
                    if key in self._step_windows:  # one sample of the last round's median to start from
                        self._step_windows[key].add(float(value))
                    self._drain_carried = self._drain_carried or key == "drain_step_s"
            every = history.get("every_steps")
            if isinstance(every, int) and not isinstance(every, bool) and every >= 1:
                self.every_steps = every  # (not AUTO_FIRST_STEPS again: the first save of this round is due as chosen)
        newest = find_latest_checkpoint(self.root, verify=None)
        if newest is None:
            # Building the optimizer's state dict would initialise its state (a zero step): not on a fresh start.
            self.checkpointer.sweep(self.root)
            return 0
        if self.model is not None and self.optimizer is not None and not self.optimizer.state:
            _allocate_optimizer_state(self.model, self.optimizer, newest.path)
        state = self._state_dict()
        info = self.checkpointer.resume(self.root, state, verify=self.verify)
        self._prepared = True  # resume reserved the staging memory
        if info is None:  # every complete checkpoint failed verification (each was logged)
            raise CheckpointError(f"no checkpoint under {self.root} could be verified")
        self._restore(state)
        steps = state.get(STEP_KEY)
        if not isinstance(steps, int):
            raise CheckpointError(f"{info.path} was not written by PeriodicCheckpointer (no {STEP_KEY})")
        self.last_saved = steps
        self._last_save_time = time.monotonic()
        self._done = steps
        self._marker = (steps, self._jit.gate.steps if self._jit is not None else 0)
        log.info("resumed from %s (%d steps done)", info.path, steps)
        return steps

    def _restore(self, state: dict[str, Any]) -> None:
        if self.model is None:
            return
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer or (), model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))

    # ------------------------------------------------------------------ saving

    def step(self, step: int) -> bool:
        """Call once per step, after step STEP (counting from 0) is done; True if a save was started.

        Collective: every rank calls it for every step.
        """
        now = time.perf_counter()
        busy = self._finalizer is not None and self._finalizer.busy()
        if self._auto and self._last_step_at is not None:  # (a step while a save drains: the drain slows it)
            self._step_windows["drain_step_s" if busy or self._draining else "step_s"].add(now - self._last_step_at)
        self._draining = busy
        started = self._step(step)
        self._last_step_at = time.perf_counter() if started else now  # (a save's own cost is not a step)
        self._ask_ahead(step + 1)
        return started

    def _step(self, step: int) -> bool:
        publishing = False
        if self._finalizer is None:
            self.checkpointer.maybe_finalize()
        else:
            publishing = not self._finalizer.idle()  # (raises the reason if publishing the last save failed)
        if not publishing and not self._prepared and self._optimizer_ready():  # reserve staging now: the first save is warm
            self.checkpointer.prepare(self._state_dict())
            self._prepared = True
            if self._finalizer is not None:  # its thread too, so the first save pays what later ones do
                self._finalizer.start_thread()
        done = self._done = step + 1
        if self._jit is not None:
            self._marker = (done, self._jit.gate.steps)  # one assignment: the JIT thread reads both at once
        if self._falls_due(done):
            self._due = True
        # Every rank takes the same collectives and acts on their common answer: a rank that was still
        # publishing at the top of this step may be idle by the time it answers, and then it saves too.
        if not self._due or not self._all_idle():
            return False
        self.save(done)
        return True

    def _all_idle(self) -> bool:
        """Nothing in flight on any rank, the same answer everywhere (inline publishing: pending counts agree)."""
        if self._finalizer is None:
            return not self.checkpointer.pending
        if self._ahead is not None:  # asked at the end of the previous step: long answered
            work, busy = self._ahead
            self._ahead = None
            work.wait()
            return not bool(busy.item())
        return not self._any_rank(not self._finalizer.idle())

    def _ask_ahead(self, done: int) -> None:
        """The step after DONE saves: ask now, without waiting, whether any rank is still publishing.

        The answer is in long before that step ends (training's own collectives go by the same group),
        so the save itself waits for no collective. A rank idle now stays idle until its next save,
        and a busy one that becomes idle meanwhile only delays the save by a step on every rank.
        """
        next_due = (done + 1 - (self.last_saved or 0)) if self._auto else (done + 1) % self.every_steps if self.every_steps else 1
        if (self._finalizer is None or self.every_steps is None or self.every_seconds is not None
                or (next_due != self.every_steps if self._auto else next_due) or self._ahead is not None
                or not _distributed()):
            return
        import torch
        import torch.distributed as dist

        busy = torch.tensor([int(self._finalizer.busy())], dtype=torch.int32)
        work = dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        self._ahead = (work, busy)
    def _optimizer_ready(self) -> bool:
        """The optimizer holds state (it has stepped): its state dict can be built without initialising it."""
        return self.optimizer is None or bool(self.optimizer.state)

    def _falls_due(self, done: int) -> bool:
        if self._auto:  # (the interval changes: counted from the last save)
            return done - (self.last_saved or 0) >= self.every_steps
        if self.every_steps is not None and done % self.every_steps == 0:
            return True
        if self.every_seconds is None:
            return False
        late = time.monotonic() - self._last_save_time >= self.every_seconds
        return self._any_rank(late)

    def _any_rank(self, flag: bool) -> bool:
        """FLAG or-ed over the ranks: the same answer everywhere."""
        return bool(max_over_ranks(int(flag), self.process_group))

    def save(self, done: int) -> None:
        """Start a save of the current state as ``step_<DONE>`` now (collective; returns after the copy).

        With the background publisher, this thread only copies the state into staging memory (``capture``);
        planning, its collectives, serialization and the hand-over to the writer run on that thread.
        """
        if self._auto:
            self._retune()
        began = time.perf_counter()
        try:
            self._save(done)
        finally:
            if self._auto:
                self._average("save_s", time.perf_counter() - began)

    def _save(self, done: int) -> None:
        state = self._state_dict()
        state[STEP_KEY] = done
        path = self.root / f"step_{done:09d}"
        self.last_saved, self._due = done, False
        self._last_save_time = time.monotonic()
        taken = time.time()  # the state of this call: reported with the checkpoint once it is complete
        if self._finalizer is None:
            self.checkpointer.async_save(state, path, step=done, taken=taken)
            return
        snap, error = None, None
        if capturable(state):
            try:
                snap = capture(state, defer=self._deferrable() if self._overlap else None)
            except Exception as exc:  # every rank abandons this save (the publisher reports it on every rank)
                error = f"copying the state into staging memory failed on this rank: {type(exc).__name__}: {exc}"
        if snap is None:  # (a DTensor / sharded state: planned and copied as before, on this thread)
            if error is None:
                self.checkpointer.async_save(state, path, step=done, taken=taken)
                self._finalizer.submit(self.checkpointer.wait)
                return
            self._finalizer.submit(lambda: self._save_and_wait(state, path, None, error, done, taken))
            return
        if snap.pending:
            self._copied.clear()
        self._finalizer.submit(lambda: self._save_and_wait(snap.state, path, snap, None, done, taken))

    def _save_and_wait(self, state: dict[str, Any], path: Path, snap: Any, error: str | None, done: int,
                       taken: float) -> None:
        """On the publisher thread: finish the copy, plan and hand the captured STATE to the writer, publish it."""
        if snap is not None and snap.pending:
            try:
                snap.finish_copy()
            except Exception as exc:  # every rank abandons this save, as for a failed copy on the training thread
                error = f"copying the state into staging memory failed on this rank: {type(exc).__name__}: {exc}"
                snap.release()
                snap = None
            finally:
                self._copied.set()
        began = time.perf_counter()
        self.checkpointer.async_save(state, path, snapshot=snap, staging_error=error, step=done, taken=taken)
        self.checkpointer.wait()
        self._measured["drain_s"] = time.perf_counter() - began  # (read by the training thread at the next save)

    # ------------------------------------------------------------------ every_steps="auto"

    def _average(self, key: str, value: float) -> None:
        old = self._measured[key]
        self._measured[key] = value if old is None else 0.8 * old + 0.2 * value

    def _retune(self) -> None:
        """Choose the interval from what was measured (collective: the ranks take the largest choice)."""
        from nvrx.ckpt import interval

        m = self._measured
        m.update({key: w.median() for key, w in self._step_windows.items() if len(w)})
        step_s = m["step_s"] or m["drain_step_s"]
        if step_s is None:
            return
        drained = interval.MIN_DRAIN_STEPS if self._drain_carried else len(self._step_windows["drain_step_s"])
        parts = interval.save_cost(step_s, m["save_s"], m["drain_s"], m["drain_step_s"], drained)
        cost = parts.total
        history = _interval_history(self.root)
        mtbf, source = self.mtbf_s, "configured mtbf_s" if self.mtbf_s is not None else ""
        ran = max(1.0, time.time() - float(history.get("first_start") or time.time()))
        if history.get("failures"):
            seen = ran / int(history["failures"])
            if mtbf is None or seen < mtbf:
                mtbf, source = seen, f"{int(history['failures'])} failure(s) in {ran:.0f} s of this job"
        elif mtbf is None:
            # No failure yet and none configured: the time run so far is the only evidence, and a lower bound of
            # the MTBF (assuming one could strike now). Saving "rarely" instead would lose everything since the
            # first save to the first fault; this interval grows with the square root of the time run.
            mtbf = max(ran, 10.0 * cost)
            source = f"no failure in {ran:.0f} s of this job yet: that time taken as a lower bound"
        choice = interval.choose(step_s, cost, m["drain_s"], mtbf, history.get("restart_s"))
        every = max_over_ranks(choice.every_steps, self.process_group)
        # reported (an event) when it changes: at most one per save, as the checkpoint_complete events
        changed = self._reported_every != every
        if every != self.every_steps:
            log.info("checkpoint interval %d -> %d steps (%s)", self.every_steps, every, choice.why)
        self.every_steps, self.interval = every, choice
        _write_interval(self.root, {**history, "every_steps": every, "choice": choice.to_dict(), "measured": dict(m)},
                        durable=False)
        if changed and _coordinator():  # for `nvrx inspect` (an event of rank 0's monitor), when the choice changes
            from nvrx.common.checkpoint_report import report_interval

            self._reported_every = every
            why = choice.why + (f" (MTBF from {source})" if source else "")
            if not parts.drain_measured:
                why += (f"; the save cost is {1000 * parts.blocked:.1f} ms blocked + the whole "
                        f"{1000 * parts.draining:.0f} ms drain (its slowdown of the steps not measured yet)")
            elif parts.draining > 0:
                why += (f"; the save cost is {1000 * parts.blocked:.1f} ms blocked + "
                        f"{1000 * parts.draining:.1f} ms of slower steps while it drains")
            if every != choice.every_steps:
                why += f"; {every} steps: the largest any rank chose"
            report_interval(every, why, seconds=choice.seconds, save_cost_s=choice.save_cost_s, step_s=choice.step_s,
                            drain_s=choice.drain_s, mtbf_s=choice.mtbf_s, restart_s=choice.restart_s,
                            expected_goodput=choice.expected_goodput)

    def _deferrable(self) -> Any:
        """Which tensors the copy may leave to the publisher: the parameters and the optimizer's state.

        Only the optimizer's step changes them in a training loop, and it waits for that copy
        (``_before_optimizer_step``); buffers (changed by forward passes) and STATE are copied at once.
        """
        import torch

        ptrs = {p.data_ptr() for p in self.model.parameters()}
        for per_param in self.optimizer.state.values():
            ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        ptrs.discard(0)
        return lambda t: t.data_ptr() in ptrs

    def _before_optimizer_step(self, *_: Any) -> None:
        """The optimizer is about to change what a save still copies in the background: wait for that copy."""
        self.wait_copied()

    def wait_copied(self) -> None:
        """Block until the last save's copy is complete (the parameters may then be changed in place)."""
        if not self._copied.is_set():
            started = time.perf_counter()
            while not self._copied.wait(_SLICE):  # in slices: the automatic heartbeat runs between them
                pass
            self.copy_wait_seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Block until the save in flight is published (collective)."""
        if self._finalizer is not None:
            self._finalizer.join()
        self.checkpointer.wait()

    def _state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {STEP_KEY: -1}
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.optimizer or ())
            state["model"] = model_sd
            if self.optimizer is not None:
                state["optim"] = optim_sd
        if self.state is not None:
            state["app"] = self.state
        return state

    def close(self) -> None:
        """Take a save that fell due but waited, publish every pending save, stop the writer process (collective).

        Call it before the rank exits.
        """
        try:
            self.wait()
            if self._due:
                self.save(self._done)
                self.wait()
        finally:
            if self._jit is not None:  # training is over: nothing to save on a failure from here on
                self._jit.close()
                self._jit = None
            if self._finalizer is not None:
                self._finalizer.stop()
        self.checkpointer.finalize_before_exit()


AUTO_FIRST_STEPS = 50  # every_steps="auto": the first save, after which the interval is chosen from measurements
INTERVAL_FILE = "nvrx_interval.json"  # in the checkpoint root: the job's start, failures seen, the chosen interval


def _coordinator() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _interval_history(root: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads((root / INTERVAL_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_interval(root: Path, data: dict[str, Any], durable: bool = True) -> None:
    """Rank 0 records DATA. DURABLE (fsynced) for a start, the failure count the next choices rest on; not for
    the choice made at each save: an fsync there blocks training while the writer streams (10-27 ms measured
    here, against ~1 ms on an idle disk), and losing the latest choice in a power cut loses nothing."""
    if not _coordinator():
        return
    import json

    from nvrx.common import files

    try:
        files.atomic_write(root / INTERVAL_FILE, json.dumps(data, indent=1, sort_keys=True).encode(), mode=0o644,
                           durable=durable)
    except OSError as exc:
        log.debug("cannot record the checkpoint interval: %s", exc)


def _record_start(root: Path) -> None:
    """Count this start in ROOT's history: the failures of this job are the restarts of each launch it ran under
    (``TORCHELASTIC_RESTART_COUNT`` of ``TORCHELASTIC_RUN_ID``), summed over `nvrx resume` continuations."""
    history = _interval_history(root)
    history.setdefault("first_start", time.time())
    runs = dict(history.get("restarts") or {})
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    runs[run] = max(int(runs.get(run, 0)), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    history.update(restarts=runs, failures=sum(runs.values()))
    _write_interval(root, history)


def _allocate_optimizer_state(model: Any, optimizer: Any, checkpoint: Path) -> None:
    """Give a fresh OPTIMIZER state (uninitialised tensors) shaped like CHECKPOINT's, so the load needs no zero optimizer step.

    ``get_state_dict`` / ``set_state_dict`` initialise an empty optimizer by running one step over zero
    gradients (for Adam and 2 M parameters ~0.1-0.3 s on a loaded CPU, on every restart); tensors the load
    overwrites anyway only need to exist. Per parameter, the checkpoint's ``optim.state.<fqn>.<key>`` entries
    say which tensors and their shapes. Anything unexpected leaves the optimizer untouched (the zero step
    then runs as before).
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from nvrx.ckpt.loader import load_metadata

    try:
        entries = load_metadata(checkpoint).state_dict_metadata
    except Exception:  # noqa: BLE001 - an optimisation only
        return
    names = {id(p): n for n, p in model.named_parameters()}
    planned: dict[Any, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            prefix = f"optim.state.{_fqn(model, names.get(id(param)))}."
            keys = {k[len(prefix):]: v for k, v in entries.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
            if not keys or not all(isinstance(v, TensorStorageMetadata) for v in keys.values()):
                return
            # empty, not zeros: the load overwrites every one of them (a failed load fails the resume anyway)
            planned[param] = {k: torch.empty(v.size, dtype=v.properties.dtype,
                                             device=param.device if tuple(v.size) == tuple(param.shape) else "cpu")
                              for k, v in keys.items()}
    for param, state in planned.items():
        optimizer.state[param] = state


def _fqn(model: Any, name: str | None) -> str | None:
    """The name ``get_state_dict`` gives a parameter (wrappers such as DDP's ``module.`` left out)."""
    if name is None:
        return None
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns

        fqns = _get_fqns(model, name)
        return next(iter(fqns)) if len(fqns) == 1 else None
    except Exception:  # noqa: BLE001 - private helper of torch; without it, the plain name
        return name


class _Finalizer:
    """One long-lived thread doing the checkpoint work handed to it; its failure is raised in the training thread.

    Started with the first save and kept (a thread start per save would cost the training thread ~1 ms).
    """

    def __init__(self, checkpointer: AsyncCheckpointer) -> None:
        self.checkpointer = checkpointer
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._work: Any = None  # the callable to run, while it runs too (None: idle)
        self._stop = False
        self._error: BaseException | None = None

    def submit(self, work: Any) -> None:
        """Run WORK on the thread (the thread is idle: the caller checked ``idle()``)."""
        with self._cond:
            assert self._work is None, "one checkpoint job at a time"
            self._work = work
            self.start_thread()
            self._cond.notify_all()

    def start_thread(self) -> None:
        """Start the thread if it does not run (it waits for work)."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._run, name="nvrx-ckpt-publish", daemon=True)
                self._thread.start()

    def start(self) -> None:
        """Publish the save just scheduled on the checkpointer."""
        self.submit(self.checkpointer.wait)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._work is None and not self._stop:
                    self._cond.wait()
                if self._work is None:
                    return
                work = self._work
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self._error = exc
            with self._cond:
                self._work = None
                self._cond.notify_all()

    def busy(self) -> bool:
        """A job runs (never raises)."""
        return self._work is not None

    def idle(self) -> bool:
        """True when no job runs; raises what made the last one fail."""
        if self._work is not None:
            return False
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True

    def join(self) -> None:
        """Wait until the job in progress is done (raises its failure)."""
        with self._cond:
            while self._work is not None:
                self._cond.wait(_SLICE)  # in slices: the automatic heartbeat runs between them
        self.idle()

    def stop(self) -> None:
        """End the thread (after the job in progress)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _own_group(process_group: Any) -> Any:
    """A gloo group over the same ranks, for the checkpoint's collectives (collective: every rank creates it)."""
    import torch.distributed as dist

    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    return dist.new_group(ranks=ranks, backend="gloo")
