"""A template process ("zygote") that imports torch once and forks ranks on request.

A restart then costs a fork (milliseconds) instead of a fresh interpreter plus ``import torch``
(1.5 s or more). The agent starts ``python -m nvrx.launcher.agent.fork_server --fd N --parent PID`` with
one end of a private ``socketpair`` inherited as fd N.

Protocol: one JSON object per SOCK_SEQPACKET message (newline-terminated, never pickle); file
descriptors travel as SCM_RIGHTS with their message.

agent -> server: ``{"op": "spawn", "id", "entry", "args", "module", "env"}`` + [stdout, stderr]
server -> agent: ``{"op": "ready", "pid", "t", "import_seconds", "threads"}`` | ``{"op": "failed", "reason"}``
                 ``{"op": "spawned", "id", "pid"}`` + [pidfd] | ``{"op": "refused", "id", "reason"}``
                 ``{"op": "exit", "pid", "exitcode", "signal"}``

The server starts no threads, never touches CUDA, and refuses to fork if CUDA got initialised.
It dies with the agent (PR_SET_PDEATHSIG) and exits when the socket closes; its ranks die with
it the same way.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nvrx.launcher.rank import bootstrap
from nvrx.common.errors import NvrxError
from nvrx.common.process import die_with_parent
log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20  # a spawn request carries a whole environment
WARM_UP_IDLE = 0.2  # seconds without a request, once ranks run, before the template warms up
# seconds without any request since the start before the template warms up anyway: a standby, or an agent waiting
# in a long rendezvous, whose first ranks would otherwise be forked cold (bench_nodeloss: 4-8 s of DDP set-up)
NEVER_ASKED_IDLE = 1.0
WARM_NAME = "nvrx-tmpl-warm"  # the template's /proc/PID/comm once warm (forked ranks set their own name)
WARMING_NAME = "nvrx-tmpl-w"  # ... + the number of the warm-up step it runs (a fork in between sees the last one)
_SERVER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # it ends with the agent, not by signal
_ORIGINAL_HANDLERS = {sig: signal.getsignal(sig) for sig in _SERVER_IGNORES}  # what a rank must get back


class ForkServerProtocolError(NvrxError):
    """A message that is not what the protocol allows (truncated, not JSON, not an object)."""


# ---------------------------------------------------------------- helpers shared with the agent


def send_msg(sock: socket.socket, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_msg(sock: socket.socket, maxfds: int, bufsize: int = MAX_MESSAGE) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and its fds (close-on-exec); (None, []) at EOF. Raises BlockingIOError if none."""
    data, fds, flags, _ = socket.recv_fds(sock, bufsize, max(maxfds, 1), socket.MSG_CMSG_CLOEXEC)
    if not data:
        close_fds(fds)
        return None, []
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ForkServerProtocolError("message truncated")
        msg = json.loads(data)
        if not isinstance(msg, dict):
            raise ForkServerProtocolError("message is not a JSON object")
    except (ValueError, ForkServerProtocolError):
        close_fds(fds)
        raise ForkServerProtocolError(f"bad message {data[:80]!r}") from None
    return msg, fds


def exit_fields(code: int | None) -> dict[str, Any]:
    """A returncode (negative = killed by that signal) as {"exitcode", "signal"}."""
    if code is None or code >= 0:
        return {"exitcode": code, "signal": None}
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"SIG{-code}"
    return {"exitcode": None, "signal": name}


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return True  # cannot tell: do not risk forking a CUDA context


# ---------------------------------------------------------------- the server


@dataclass(frozen=True)
class ChildJob:
    """What a freshly forked child runs once it has unwound out of the server loop."""

    entry: str
    args: list[str]
    module: bool


class _Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, int] = {}  # pid -> pidfd
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.entry: tuple[str, bool] | None = None  # the last request's (entry, module): what ranks run
        # first-use costs, paid step by step while ranks run (see _wait); last, the user's script is compiled
        self.warm_up = WarmUp([*WARM_UP_STEPS, self._precompile_entry])
        self.burst_intact = False  # every rank forked since the last request still runs: no respawn is coming

    def _wait(self) -> list:
        """The next events; while the ranks run and nothing is asked (or before anything was ever asked: a
        standby, a long rendezvous), warm the template one step at a time.

        The first step waits for WARM_UP_IDLE quiet seconds (the agent sends a round's spawn requests one after
        the other), the next ones follow at once; any event (a request, a rank's exit) pauses the warm-up, so a
        respawn waits for one step at most, never for the whole warm-up. It resumes only while every rank forked
        since the last request runs: after a rank's exit a respawn is likely, and it should find the server idle.
        A step is done or not done when the server forks: the warm-up runs here, in the one thread, never
        in another one a rank could inherit half-way.
        """
        while self._may_warm():
            ready = self.sel.select(timeout=WARM_UP_IDLE if self.children else NEVER_ASKED_IDLE)
            while not ready and self._may_warm():
                _set_comm(f"{WARMING_NAME}{self.warm_up.position}")
                self.warm_up.step()
                if self.warm_up.done:
                    _set_comm(WARM_NAME)
                ready = self.sel.select(timeout=0)
            if ready:
                return ready
        return self.sel.select()

    def _may_warm(self) -> bool:
        """Warm while every rank forked since the last request runs, or before any request at all (then without
        the last step, which compiles the entry a request names)."""
        if self.warm_up.done:
            return False
        if self.entry is None:
            return self.warm_up.position < len(WARM_UP_STEPS)
        return bool(self.children) and self.burst_intact

    def _precompile_entry(self) -> None:
        if self.entry is not None:
            bootstrap.precompile(*self.entry)

    def serve(self) -> ChildJob | None:
        """Serve until the agent goes away (None), or return the job in a forked child."""
        while True:
            for key, _ in self._wait():
                if key.data is not None:
                    self._reap(key.data)
                    continue
                try:
                    msg, fds = recv_msg(self.sock, 2)
                except (BlockingIOError, InterruptedError):
                    continue
                except ForkServerProtocolError as exc:
                    log.warning("fork server: %s", exc)
                    continue
                except OSError:
                    return None
                if msg is None:
                    return None
                job = self._handle(msg, fds)
                if job is not None:
                    return job

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> ChildJob | None:
        if msg.get("op") != "spawn" or len(fds) != 2:
            close_fds(fds)
            self._reply({"op": "refused", "id": msg.get("id"), "reason": f"bad request {msg.get('op')!r} with {len(fds)} fds"})
            return None
        self.burst_intact = True
        self.entry = (str(msg.get("entry")), bool(msg.get("module")))
        if _cuda_initialized():
            close_fds(fds)
            self._reply({"op": "refused", "id": msg.get("id"), "reason": "CUDA is initialised in the fork server"})
            return None
        return self._fork(msg, fds)

    def _fork(self, msg: dict[str, Any], fds: list[int]) -> ChildJob | None:
        bootstrap.flush_stdio()
        try:
            pid = os.fork()
        except OSError as exc:
            close_fds(fds)
            self._reply({"op": "refused", "id": msg.get("id"), "reason": f"fork failed: {exc}"})
            return None
        if pid == 0:
            try:
                return self._become_rank(msg, fds)
            except BaseException:
                try:
                    traceback.print_exc()
                finally:
                    os._exit(70)
        close_fds(fds)
        try:
            os.setpgid(pid, pid)  # also done by the child; whoever is first wins the race
        except OSError:
            pass
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # cannot watch it, so it must not run
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self._reply({"op": "refused", "id": msg.get("id"), "reason": f"pidfd_open failed: {exc}"})
            return None
        self.children[pid] = pidfd
        self.sel.register(pidfd, selectors.EVENT_READ, pid)
        self._reply({"op": "spawned", "id": msg.get("id"), "pid": pid}, [pidfd])
        return None

    def _become_rank(self, msg: dict[str, Any], fds: list[int]) -> ChildJob:
        """Child side: own process group, die with the server, rank's stdio and env, default signals."""
        os.setpgid(0, 0)
        die_with_parent(self.pid)
        # Handlers first, then the mask: a SIGTERM the agent sent before this point waits, blocked, instead of
        # being dropped by the server's SIG_IGN, and is delivered at the unblock below.
        for sig, handler in _ORIGINAL_HANDLERS.items():
            if handler is not None:
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        close_fds(fds)
        self.sel.close()
        close_fds(list(self.children.values()))
        self.sock.close()
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in dict(msg.get("env") or {}).items()})
        _reseed_numpy()
        _reseed_torch()
        return ChildJob(entry=str(msg["entry"]), args=[str(a) for a in msg.get("args") or ()], module=bool(msg.get("module")))

    def _reap(self, pid: int) -> None:
        self.burst_intact = False
        pidfd = self.children.pop(pid)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = None
        self._reply({"op": "exit", "pid": pid, **exit_fields(code)})

    def _reply(self, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
        try:
            send_msg(self.sock, obj, fds)
        except OSError:
            pass  # the agent is gone; EOF on the next select ends the server


def _reseed_numpy() -> None:
    """Each fresh interpreter seeds numpy's global RNG from the OS; forks would all share one state."""
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:
        try:
            nprandom.seed()
        except Exception:
            pass


def _reseed_torch() -> None:
    """``import torch`` seeds its CPU generator from the OS in every fresh interpreter; forks would share one seed.

    Only the CPU generator, as the import does (CUDA's are seeded when CUDA starts, never in the template).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.default_generator.seed()
        except Exception:
            pass


def _parse_args(argv: list[str]) -> tuple[int, int]:
    opts = dict(zip(argv[::2], argv[1::2]))
    return int(opts["--fd"]), int(opts["--parent"])


def _import_template() -> None:
    """Everything a rank would otherwise import itself; nothing that starts threads or CUDA."""
    import warnings

    # torch's notice about a missing numpy would land on the agent's terminal once per server start.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

    # Keep the collector off the template's objects in every child: scanning them would
    # copy-on-write most of the heap (a forked rank's exit took ~3x longer without this).
    # No gc.collect() first: it found ~40 objects to free and took ~0.1 s, on the start-up path.
    gc.freeze()


def _set_comm(name: str) -> None:
    """This process's name in /proc/PID/comm and ps (best effort): tells whether the template is warm yet."""
    try:
        with open(f"/proc/{os.getpid()}/comm", "w") as fh:
            fh.write(name)
    except OSError:
        pass


def _import_optional(name: str) -> None:
    """Import NAME if its dependencies are installed (torch tries some modules only if fsspec is there).

    Only a missing module is skipped: any other ImportError (a circular import when steps run in an order torch
    did not foresee) ends the warm-up (WarmUp.step), so a half-imported package is not built on.
    """
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass


def _build_throwaway_optimizer() -> None:
    """Builds an optimizer over one zero tensor: imports the rest of what ``torch.optim`` needs; patches Adam.step once."""
    import torch

    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


# The warm-up, in steps of at most ~0.5 s (idle machine). Measured on the benchmark workload (bench/bench_goodput.py),
# a rank spent ~1 s building its first ``torch.optim`` optimizer (it imports ``torch._dynamo``, sympy, DTensor, parts of
# FSDP and inductor), ~0.05 s on the DCP and DDP imports and ~0.1 s more on its first DCP load (serialization config,
# fsspec). The first steps import, one at a time and outside torch._dynamo's package (whose import cannot be cut),
# what the optimizer's import of torch._dynamo would import anyway (tests/unit/test_fork_warmup.py checks that the
# steps import nothing the optimizer would not). Only imports and an optimizer over one zero tensor: nothing that
# draws random numbers, changes torch's thread settings, starts a thread, or touches CUDA (each property is tested
# in tests/integration/test_template_warmup.py).
WARM_UP_STEPS: tuple[str | Callable[[], None], ...] = (
    "mpmath", "sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed._functional_collectives",
    "torch.distributed.tensor", "torch.onnx.ops", "torch.distributed.fsdp",
    "torch._functorch._aot_autograd.collect_metadata_analysis", "torch._dynamo",
    _build_throwaway_optimizer,
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.nn.parallel",  # DistributedDataParallel
    "torch.utils.serialization.config", "torch._weights_only_unpickler",  # torch.load / torch.save (and DCP) on first use
    "torch.distributed.checkpoint._fsspec_filesystem",  # tried by every dcp.load/save (if fsspec is installed)
    "torch.profiler._cupti_monitor",  # the first backward pass imports it
    # what a rank saving and resuming with `nvrx.ckpt` imports (kept listed in the rank: its `from nvrx import ckpt` costs nothing)
    "nvrx.ckpt.periodic", "nvrx.ckpt.api", "nvrx.ckpt.loader", "nvrx.ckpt.manifest", "nvrx.ckpt.publish", "nvrx.ckpt.snapshot",
    "nvrx.ckpt.async_ckpt.state_dict_saver", "nvrx.ckpt.async_ckpt.filesystem_async", "nvrx.ckpt.async_ckpt.core",
    "nvrx.ckpt.async_ckpt.file_writer", "nvrx.ckpt.async_ckpt.cached_metadata_filesystem_reader", "nvrx.common.files",
)


class WarmUp:
    """Pays once, in the template, the first-use costs every restarted rank would pay again; one step per call.

    A step is an import (skipped when its dependencies are not installed) or a callable. A failing step ends the
    warm-up: it costs speed only, never the template. After each step the collector is run over what the step
    made and the survivors are frozen, as after the template's imports: scanning them in every child would copy
    most of the heap on write.
    """

    def __init__(self, steps: Sequence[str | Callable[[], None]]) -> None:
        self._steps = list(steps)
        self.position = 0  # the number of steps done
        self.failed: str | None = None  # the step that failed and ended the warm-up

    @property
    def done(self) -> bool:
        return self.position >= len(self._steps)

    def step(self) -> None:
        """Run the next step."""
        todo = self._steps[self.position]
        self.position += 1
        try:
            if callable(todo):
                todo()
            else:
                _import_optional(todo)
        except Exception:  # noqa: BLE001 - an optional speed-up
            log.debug("fork server warm-up failed at %r", todo, exc_info=True)
            self.failed = getattr(todo, "__name__", str(todo))
            self.position = len(self._steps)
        gc.collect()
        gc.freeze()

    def run_all(self) -> None:
        while not self.done:
            self.step()


def main(argv: list[str] | None = None) -> None:
    fd, parent = _parse_args(sys.argv[1:] if argv is None else argv)
    die_with_parent(parent)
    for sig in _SERVER_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    # Also blocked: a blocked signal is queued even while ignored, so one sent to a rank just forked (still with
    # the server's dispositions) is not lost; the rank unblocks it once its own handlers are back.
    signal.pthread_sigmask(signal.SIG_BLOCK, _SERVER_IGNORES)
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    start = time.monotonic()
    try:
        _import_template()
        ready = {"op": "ready", "pid": os.getpid(), "t": time.time(), "import_seconds": round(time.monotonic() - start, 3), "threads": _thread_count()}
    except BaseException as exc:  # noqa: BLE001 - anything here means "no template"; tell the agent
        ready = {"op": "failed", "reason": f"importing torch failed: {exc!r}"}
    try:
        send_msg(sock, ready)
    except OSError:
        os._exit(0)  # the agent is already gone
    job = _Server(sock).serve() if ready["op"] == "ready" else None
    if job is None:  # the agent is gone or done with us: nothing to flush or tear down
        bootstrap.flush_stdio()
        os._exit(0)
    bootstrap.exit_with(bootstrap.run_user_code(job.entry, job.args, job.module))


if __name__ == "__main__":
    main()
