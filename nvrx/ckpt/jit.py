"""Just-in-time checkpoints: when a peer fails, a survivor saves the state of its last completed optimizer step.

With a checkpoint every few hundred steps, a fault throws away half an interval of work on average. In
data-parallel training every surviving replica still holds the model and optimizer state of the last step
that completed everywhere, so one survivor can save it after the failure and the restarted job loses at most
the step that was under way.

How it fits together (``nvrx launch --jit-ckpt``, docs/guides/checkpoints.md):

* ``PeriodicCheckpointer(..., save_on_failure=True)`` registers a ``JitCheckpointer`` here and puts a
  ``StepGate`` around its optimizer's ``step()`` (torch's per-optimizer pre/post step hooks): a lock held
  while the optimizer changes parameters, plus a count of completed steps. The gate costs two uncontended
  lock operations per optimizer step.
* The rank bootstrap parks a thread on the rank monitor (``nvrx.launcher.rank.jit_link``); when the agent
  learns a rank crashed, hung or its node left, it asks each surviving rank's monitor, before it stops the
  survivors, and the parked thread calls ``serve`` here.
* That thread runs while the rank's main thread is blocked in a collective waiting for the dead peer. It takes
  the gate (so never inside ``optimizer.step()``; a main thread that never leaves the step makes it give up
  at the deadline), and writes the checkpoint with no collective at all (``SOLO``): the state is replicated,
  so one survivor writes it for everyone: the lowest surviving rank. It is published like any checkpoint
  (``.NAME.partial``, fsync, manifest, atomic rename): the restarted job's ``resume()`` takes the newest
  complete one, JIT or periodic. A save not done by the deadline is not published (the agent stops the
  rank; a partial directory left by SIGKILL is swept on resume).
* Sharded state (DTensor / ShardedTensor) has one holder per shard: a lost rank's shard cannot be saved by
  anyone else, so the job falls back to the newest periodic checkpoint, said in one log line.

The same save serves the other checkpointers: ``TwoTierCheckpointer(..., save_on_failure=True,
optimizer=opt)`` writes ``jit_iter_<iteration>`` into its global tier (its ``resume`` takes it like any
global iteration, when newer than the local tier's), and users of the plain ``nvrx.ckpt`` functions call
``ckpt.save_on_failure(root, optimizer=opt, state_fn=..., steps_done=start)`` once after ``ckpt.resume``:
``jit_step_<steps done>`` in ROOT, which the next ``ckpt.resume(root, state)`` loads like any checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nvrx.common.files import private_dir

log = logging.getLogger("nvrx.ckpt.jit")

JIT_ENV = "NVRX_JIT_CKPT"  # set by `nvrx launch --jit-ckpt` for the ranks: the agent's bound, seconds
DEFAULT_TIMEOUT = 5.0
NAME_PREFIX = "jit_step_"  # a JIT checkpoint's name: jit_step_<steps done>; never a periodic save's partial


class StepGate:
    """Knows when OPTIMIZER's state is consistent: not inside ``step()``; counts completed steps.

    The pre-step hook takes a lock and the post-step hook releases it, so another thread holding the lock
    (``hold``) sees parameters and optimizer state between two steps, and the next step waits for it.
    """

    def __init__(self, optimizer: Any) -> None:
        self._lock = threading.Lock()
        self._inside = False  # the optimizer's thread holds the lock (between the hooks)
        self.steps = 0  # completed optimizer steps
        self._handles = (optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post))

    def _pre(self, *_: Any) -> None:
        if self._inside:  # the previous step raised before its post hook: it is over
            self._inside = False
            self._lock.release()
        self._lock.acquire()
        self._inside = True

    def _post(self, *_: Any) -> None:
        self.steps += 1
        self._inside = False
        self._lock.release()

    def hold(self, timeout: float) -> bool:
        """Wait up to TIMEOUT s for a point between two optimizer steps and keep the optimizer out; True if held."""
        return self._lock.acquire(timeout=max(0.0, timeout))

    def release(self) -> None:
        self._lock.release()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class JitCheckpointer:
    """What one rank saves on failure: a state function, where, and which step it holds.

    STATE_FN(): the state dict to save (called with the gate held). STEPS_FN(gate_steps) -> the steps done
    that state holds, or a string saying why it cannot tell. ROOT: the checkpoint directory (the periodic
    checkpoints' own). NEWEST_FN(): the steps held by the newest published checkpoint (a JIT save that adds
    nothing is skipped).
    """

    def __init__(self, root: Path, optimizer: Any, state_fn: Callable[[], dict[str, Any]],
                 steps_fn: Callable[[int], int | str], newest_fn: Callable[[], int | None],
                 keep_last: int | None = None, step_key: str | None = "nvrx_steps_done",
                 name_format: str = NAME_PREFIX + "{:09d}") -> None:
        self.root = Path(root)
        # where the state records its steps done (PeriodicCheckpointer's STEP_KEY; None: only the name says it)
        self.step_key = step_key
        self.name_format = name_format  # the checkpoint's name from its steps done
        self.gate = StepGate(optimizer)
        self.state_fn, self.steps_fn, self.newest_fn = state_fn, steps_fn, newest_fn
        self.keep_last = keep_last
        self.module_level = False  # armed by ckpt.save_on_failure (disarmed by ckpt.finalize_before_exit)

    def save(self, lost: list[int], rank: int, world_size: int, deadline: float,
             saver: int | None = None) -> dict[str, Any]:
        """Save now if this rank is the one to (SAVER, chosen by the agents when the lost ranks are not known;
        else the lowest surviving); the result as JSON for the agent."""
        started = time.monotonic()
        if saver is None:
            alive = [r for r in range(world_size) if r not in set(lost)]
            saver = alive[0] if alive else None
        if saver is None or rank != saver:
            return {"saved": False, "skipped": f"rank {saver if saver is not None else '?'} saves the replicated state"}
        if not self.gate.hold(deadline - time.monotonic()):
            return {"saved": False, "error": "the training thread stayed inside optimizer.step() until the "
                                             "deadline: no consistent state to save"}
        try:
            done = self.steps_fn(self.gate.steps)
            if isinstance(done, str):
                return {"saved": False, "error": done}
            newest = self.newest_fn()
            if done <= (newest or 0):
                return {"saved": False, "skipped": f"nothing newer than the checkpoint of step {newest}", "step": done}
            taken = time.time()
            state = dict(self.state_fn())  # (a copy of the top level: the step key is not added to the user's dict)
            sharded = _sharded(state)
            if sharded:
                return {"saved": False, "step": done,
                        "error": f"sharded state ({sharded}): the shards of lost rank(s) "
                                 f"{sorted(lost) if lost else '(not named)'} have no other holder"}
            path = self.root / self.name_format.format(done)
            if self.step_key is not None:
                state[self.step_key] = done
            private_dir(self.root)  # (a tier that has no checkpoint yet)
            save_alone(state, path, deadline, keep_last=self.keep_last)
            _report(done, taken, path)
        except Exception as exc:  # noqa: BLE001 - reported to the agent; the job restarts as it would anyway
            return {"saved": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.gate.release()
        return {"saved": True, "path": str(path), "step": done, "seconds": round(time.monotonic() - started, 4)}

    def close(self) -> None:
        self.gate.remove()
        unregister(self)


def save_alone(state: dict[str, Any], path: Path, deadline: float, keep_last: int | None = None) -> None:
    """Write STATE as checkpoint PATH from this process alone (no collective, no writer process); publish it
    unless DEADLINE (time.monotonic) has passed by then (TimeoutError: nothing is published)."""
    from nvrx.ckpt.async_ckpt.dist_wrapper import SOLO
    from nvrx.ckpt.async_ckpt.file_writer import write_files
    from nvrx.ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvrx.ckpt.async_ckpt.state_dict_saver import save_state_dict_async_finalize, save_state_dict_async_plan

    writer = FileSystemWriterAsync(path, files_per_rank=1, keep_last=keep_last, update_latest=True)
    writer, metadata, dw = save_state_dict_async_plan(state, writer, SOLO, enable_cache=False)
    published = False
    try:
        job, buffer, _ = writer.write_job()
        started = time.perf_counter()
        files = write_files(memoryview(buffer.mm), job["dir"], job["files"], fsync=job.get("fsync", True))
        writer.record_reply({"files": files, "seconds": time.perf_counter() - started})
        if time.monotonic() > deadline:
            raise TimeoutError("the deadline passed before the checkpoint was durable")
        save_state_dict_async_finalize(writer, metadata, dw)
        published = True
    finally:
        if not published:
            writer.discard_partial()
            writer.release_staging()


def _report(step: int, taken: float, path: Path) -> None:
    """Tell the rank's monitor the checkpoint is complete (issue 31's report, for `nvrx inspect`), where it exists."""
    try:
        from nvrx.common.checkpoint_report import report_checkpoint
    except ImportError:
        return
    report_checkpoint(step, "jit", taken=taken, path=str(path))


def _sharded(state: Any) -> str | None:
    """The first DTensor / ShardedTensor in STATE (its type name), or None: such a tensor has one holder per shard."""
    if isinstance(state, dict):
        for value in state.values():
            found = _sharded(value)
            if found:
                return found
    elif isinstance(state, (list, tuple)):
        for value in state:
            found = _sharded(value)
            if found:
                return found
    elif hasattr(state, "to_local") or hasattr(state, "local_shards"):
        return type(state).__name__
    return None


# ------------------------------------------------------------------ the process's registry

_lock = threading.Lock()
_registered: list[JitCheckpointer] = []


def register(saver: JitCheckpointer) -> None:
    with _lock:
        _registered.append(saver)


def unregister(saver: JitCheckpointer) -> None:
    with _lock:
        if saver in _registered:
            _registered.remove(saver)


def enabled() -> bool:
    """This rank runs under `nvrx launch --jit-ckpt` (the agent will ask it to save on failure)."""
    return bool(os.environ.get(JIT_ENV))


def save_on_failure(root: str | os.PathLike, *, optimizer: Any, state_fn: Callable[[], dict[str, Any]],
                    steps_done: int = 0, step_key: str | None = "step",
                    keep_last: int | None = None) -> JitCheckpointer | None:
    """For the plain ``nvrx.ckpt`` functions: under ``nvrx launch --jit-ckpt``, when another rank fails, the
    lowest surviving rank saves ``STATE_FN()`` as ``ROOT/jit_step_<steps done>`` (None elsewhere: nothing armed).

    Call it once after ``ckpt.resume`` (STEPS_DONE: the steps the resumed state holds, 0 on a fresh start); the
    steps done at a failure are STEPS_DONE plus OPTIMIZER's completed ``step()`` calls since, and the saved state
    holds them under STEP_KEY (None: not added). STATE_FN is called on another thread, between two optimizer
    steps; it declares the state replicated on every rank (DDP): sharded state is detected and not saved. The
    next ``ckpt.resume(root, state)`` loads the JIT checkpoint like any other (the newest complete one).
    ``close()`` on the result (or ``ckpt.finalize_before_exit()``) disarms it when training is over.
    """
    if not enabled():
        log.info("ckpt.save_on_failure has no effect without `nvrx launch --jit-ckpt`")
        return None
    if not isinstance(steps_done, int) or isinstance(steps_done, bool) or steps_done < 0:
        raise ValueError(f"steps_done must be an int >= 0, not {steps_done!r}")
    root = Path(os.path.abspath(root))

    def newest() -> int | None:
        from nvrx.ckpt.loader import find_latest_checkpoint

        info = find_latest_checkpoint(root, verify=None)
        digits = re.search(r"(\d+)$", info.path.name) if info is not None else None  # step_<n>, jit_step_<n>
        return int(digits.group(1)) if digits else None

    saver = JitCheckpointer(root, optimizer, state_fn, lambda gate_steps: steps_done + gate_steps, newest,
                            keep_last=keep_last, step_key=step_key)
    saver.module_level = True
    register(saver)
    return saver


def disarm_module_level() -> None:
    """``ckpt.finalize_before_exit``: training is over, what ``save_on_failure`` armed saves nothing any more."""
    with _lock:
        savers = [s for s in _registered if s.module_level]
    for saver in savers:
        saver.close()


def serve(request: dict[str, Any], rank: int) -> dict[str, Any]:
    """The agent's request (lost ranks, world size, deadline): save with the checkpointer registered here."""
    with _lock:
        savers = list(_registered)
    if not savers:
        return {"saved": False, "skipped": "no checkpointer with save_on_failure=True in this rank"}
    lost = [int(r) for r in request.get("lost") or []]
    world = int(request.get("world_size") or 0) or int(os.environ.get("WORLD_SIZE", "1"))
    deadline = float(request.get("deadline") or (time.monotonic() + DEFAULT_TIMEOUT))
    saver = request.get("saver")
    saver = int(saver) if isinstance(saver, int) and not isinstance(saver, bool) else None
    result = savers[-1].save(lost, rank, world, deadline, saver=saver)
    if result.get("saved"):
        log.info("just-in-time checkpoint of step %s saved: %s (%.2f s)", result["step"], result["path"],
                    result["seconds"])
    elif result.get("error"):
        log.info("no just-in-time checkpoint: %s; the restart resumes from the newest periodic/local checkpoint",
                    result["error"])
    return result
