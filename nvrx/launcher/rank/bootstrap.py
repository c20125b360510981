"""Run a rank's user code exactly as ``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` would.

Two callers: a spawned rank runs ``python -P -m nvrx.launcher.rank.bootstrap [-m] ENTRY ARGS...``, and the
fork server calls :func:`run_user_code` in a freshly forked child. Either way the user must not
be able to tell: ``__main__``, ``sys.argv``, ``sys.path[0]``, exit codes, and tracebacks (with no
launcher frames) match the plain interpreter.

Exit codes returned by :func:`run_user_code` are 0..255, or ``-signum`` when the process must
die by that signal (an uncaught KeyboardInterrupt dies by SIGINT, as python does).
"""

from __future__ import annotations

import atexit
import gc
import io
import builtins
import importlib.machinery
import importlib.util
import os
import signal
import stat
import sys
import threading
import time
import types
import warnings
from typing import NoReturn

# Ranks attach to their monitor with these. Every nvrx module lives under the one `nvrx` package, so none
# of them can shadow a user's module (a user's `launcher.py`, `ckpt/`, ...) and they stay listed.
from nvrx.monitors import client as monitor_client
from nvrx.monitors.progress_watchdog import ProgressWatchdog
from nvrx.ckpt.async_ckpt import writer_process as ckpt_writer  # light: no torch import
from nvrx.ckpt import auto_reserve as ckpt_auto_reserve  # light: no torch import
from nvrx.common.process import set_process_title

FULL_EXIT_ENV = "NVRX_FULL_EXIT"  # "1": end ranks through the full interpreter teardown
INPROCESS_ENV = "NVRX_INPROCESS"  # "1": run the script inside an in-process restart Wrapper (nvrx launch --inprocess)

# Frames of these files sit between the interpreter and the user's code; tracebacks skip them.
_LAUNCHER_FILES = frozenset(os.path.abspath(f) for f in (__file__, importlib.util.__file__) if f)


class _NotRunnable(BaseException):
    """The entry point cannot be run; python reports this as ``<python>: <message>``.

    A BaseException (so not an ``NvrxError``) so that an in-process restart Wrapper ends on it instead of
    retrying: the Wrapper restarts on ``Exception``s.
    """

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _pythonpath_entries(value: str | None) -> list[str]:
    return [os.path.abspath(p) for p in (value or "").split(os.pathsep) if p]


# The PYTHONPATH this interpreter's sys.path reflects; a forked rank may be given another one.
_SYS_PATH_PYTHONPATH = os.environ.get("PYTHONPATH")


def _sync_sys_path_with_env() -> None:
    """After fork the environment may carry a different PYTHONPATH than the template had; apply it."""
    global _SYS_PATH_PYTHONPATH
    current = os.environ.get("PYTHONPATH")
    if current == _SYS_PATH_PYTHONPATH:
        return
    for entry in _pythonpath_entries(_SYS_PATH_PYTHONPATH):
        try:
            sys.path.remove(entry)
        except ValueError:
            pass
    sys.path[0:0] = _pythonpath_entries(current)
    _SYS_PATH_PYTHONPATH = current


_main_path: str | None = None  # what _set_main_path put first on sys.path (replaced, not stacked, by a re-run)


def _set_main_path(entry: str) -> None:
    """Put ENTRY first on sys.path, where ``python SCRIPT`` / ``python -m`` puts the script's directory / cwd.

    Our interpreters start with ``-P`` (nothing prepended: the directory nvrx was started from must not
    shadow our imports); one started without it has the directory to replace in sys.path[0]. The Wrapper's
    in-process restart runs the script again in this process: the entry put there before is replaced.
    """
    global _main_path
    ours = _main_path is not None and sys.path[:1] == [_main_path]  # an in-process restart runs the script again
    if sys.flags.safe_path and not ours:
        sys.path.insert(0, entry)
    else:
        sys.path[0] = entry
    _main_path = entry


def _line_buffer_stdout() -> None:
    """Make prints appear promptly through the relay pipe, as they would on a terminal."""
    try:
        if stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):
        pass


def _fresh_main(**attrs: object) -> types.ModuleType:
    """Install a new ``__main__`` for the whole process lifetime (pickle and multiprocessing need it)."""
    main = types.ModuleType("__main__")
    main.__dict__.update({"__builtins__": builtins, "__cached__": None, "__package__": None, "__spec__": None})
    main.__dict__.update(attrs)
    sys.modules["__main__"] = main
    if "__mp_main__" in sys.modules:  # multiprocessing's alias of __main__, made when it was imported before us
        sys.modules["__mp_main__"] = main
    return main


# The user's script compiled once by the rank template (its warm-up): path -> (source, code).
_COMPILED: dict[str, tuple[bytes, types.CodeType]] = {}


def _compile_script(source: bytes, abspath: str) -> types.CodeType:
    return compile(source, abspath, "exec", dont_inherit=True)


def precompile(entry: str, module: bool) -> None:
    """In the rank template: compile the script its ranks run, so a rank forked later need not.

    ``python SCRIPT`` compiles the script at every start (no bytecode cache for ``__main__``): a few ms for a
    short script, tens for a long one, on every restart's path. A rank uses this code only if the file still
    holds the very same source. Modules (``-m``) come with their cached bytecode already.
    """
    if module:
        return
    abspath = os.path.abspath(entry)
    try:
        with open(abspath, "rb") as fh:
            source = fh.read()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = _compile_script(source, abspath)
    except (OSError, SyntaxError, ValueError):
        return  # the rank reports it, as python would
    if not caught:  # a script that warns when compiled is compiled by each rank, which shows the warnings as python does
        _COMPILED[abspath] = (source, code)


def _run_script(path: str, args: list[str]) -> None:
    if os.path.isdir(path):
        _run_directory(path, args)
        return
    abspath = os.path.abspath(path)
    try:
        with open(abspath, "rb") as fh:
            source = fh.read()
    except OSError as exc:
        raise _NotRunnable(f"can't open file {abspath!r}: [Errno {exc.errno}] {exc.strerror}", 2) from None
    sys.argv = [path, *args]
    _set_main_path(os.path.dirname(os.path.realpath(abspath)))
    main = _fresh_main(__file__=abspath, __loader__=importlib.machinery.SourceFileLoader("__main__", abspath))
    cached = _COMPILED.pop(abspath, None)
    code = cached[1] if cached is not None and cached[0] == source else _compile_script(source, abspath)
    exec(code, main.__dict__)


def _run_directory(path: str, args: list[str]) -> None:
    """``python DIR`` runs DIR/__main__.py with DIR first on sys.path."""
    _set_main_path(path)
    spec = importlib.machinery.PathFinder.find_spec("__main__", [path])
    if spec is None or spec.loader is None:
        raise _NotRunnable(f"can't find '__main__' module in {path!r}")
    sys.argv = [path, *args]
    _exec_spec(spec, "__main__")


def _find_module_spec(name: str) -> importlib.machinery.ModuleSpec:
    """Like python -m: a module, or a package's __main__ submodule."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise _NotRunnable(f"Error while finding module specification for {name!r} ({type(exc).__name__}: {exc})") from None
    if spec is None:
        raise _NotRunnable(f"No module named {name}")
    if spec.submodule_search_locations is not None:
        if name == "__main__" or name.endswith(".__main__"):
            raise _NotRunnable("Cannot use package as __main__ module")
        try:
            return _find_module_spec(name + ".__main__")
        except _NotRunnable as exc:
            raise _NotRunnable(f"{exc}; {name!r} is a package and cannot be directly executed") from None
    if spec.loader is None:
        raise _NotRunnable(f"No module named {name}")
    return spec


def _exec_spec(spec: importlib.machinery.ModuleSpec, name: str) -> None:
    code = spec.loader.get_code(name)  # type: ignore[union-attr]
    if code is None:
        raise _NotRunnable(f"No code object available for {name}")
    main = _fresh_main(__file__=spec.origin, __cached__=spec.cached, __loader__=spec.loader, __package__=spec.parent, __spec__=spec)
    exec(code, main.__dict__)


def _run_module(name: str, args: list[str]) -> None:
    _set_main_path(os.getcwd())
    spec = _find_module_spec(name)
    sys.argv = [spec.origin or name, *args]
    _exec_spec(spec, spec.name)


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop the leading launcher frames so the traceback starts where python's would."""
    while tb is not None and _is_launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _is_launcher_frame(filename: str) -> bool:
    return filename.startswith("<frozen importlib") or filename.startswith("<frozen runpy") or filename in _LAUNCHER_FILES


def _print_uncaught(exc: BaseException) -> None:
    """Report an uncaught exception through sys.excepthook, as the interpreter does."""
    tb = _user_traceback(exc.__traceback__)
    exc.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_exc:  # python's own fallback when the hook itself fails
        sys.stderr.write("Error in sys.excepthook:\n")
        sys.__excepthook__(type(hook_exc), hook_exc, hook_exc.__traceback__)
        sys.stderr.write("\nOriginal exception was:\n")
        sys.__excepthook__(type(exc), exc, tb)


def _system_exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def _attach_to_monitor(started: float) -> None:
    """Connect this rank to its monitor before user code runs (in the background: no start-up delay)."""
    if not os.environ.get(monitor_client.ENV_SOCKET):  # set by the agent when this rank has a monitor
        return
    interval = os.environ.get(monitor_client.ENV_AUTO_HEARTBEAT)

    jit = bool(os.environ.get("NVRX_JIT_CKPT"))  # nvrx launch --jit-ckpt (nvrx.ckpt.jit.JIT_ENV)

    def on_attached(link: monitor_client.MonitorLink) -> None:
        if interval:
            link.arm(())
            ProgressWatchdog(link.writer.auto_beat, float(interval)).start()
        if jit:  # park a thread on the monitor: the agent asks through it for a save when a peer fails
            from nvrx.launcher.rank import jit_link

            jit_link.start(link.socket_path, link._token, int(os.environ.get("RANK", "0")))

    # Takes NVRX_MONITOR_TOKEN out of os.environ before returning, i.e. before user code can start a
    # process that would inherit it; the client keeps it for this process.
    monitor_client.attach_in_background(os.environ, started=started, on_attached=on_attached)


def _inprocess_mode() -> types.ModuleType | None:
    """`nvrx launch --inprocess`: the runner, imported before user code runs."""
    if os.environ.get(INPROCESS_ENV) != "1":
        return None
    from nvrx.launcher.rank.inprocess import launch_mode

    return launch_mode


def torchrun_command_line(entry: str, args: list[str], module: bool) -> list[str]:
    """The command line torchrun starts a rank with: ``[python, -u, (-m,) ENTRY, *ARGS]``."""
    return [sys.executable or "python", "-u", *(["-m"] if module else []), entry, *args]


def run_user_code(entry: str, args: list[str], module: bool) -> int:
    """Run ENTRY as ``__main__`` in this process; return its exit code (``-signum`` = die by signal)."""
    # First, before the monitor link's thread may read the environment: ps, top, pgrep -f and GPU process
    # lists then show the rank as torchrun's, not as the template process or `-m nvrx.launcher.rank.bootstrap`.
    set_process_title(torchrun_command_line(entry, args, module))
    started = time.monotonic()
    # nvrx launch --async-ckpt: this rank's writer, started once; first, while no other thread runs (it is forked)
    ckpt_writer.start_if_requested(os.environ)
    if os.environ.get(ckpt_writer.ASYNC_CKPT_ENV) == "1":
        # staging reserved after the first optimizer step: the first save is warm. A forked rank has torch.optim
        # loaded (hook registered now, no thread); a spawned one registers it when the script imports torch
        ckpt_auto_reserve.arm()
    _attach_to_monitor(started)
    inprocess = _inprocess_mode()
    _sync_sys_path_with_env()
    _line_buffer_stdout()
    try:
        try:
            run = (lambda: _run_module(entry, list(args))) if module else (lambda: _run_script(entry, list(args)))
            if inprocess is not None:
                return inprocess.run(run, os.environ)
            run()
        except _NotRunnable as exc:
            sys.stderr.write(f"{sys.executable}: {exc}\n")
            return exc.code
    except SystemExit as exc:
        return _system_exit_code(exc)
    except KeyboardInterrupt as exc:
        _print_uncaught(exc)
        return -signal.SIGINT
    except BaseException as exc:
        _print_uncaught(exc)
        _hold_exit_for_jit(exc)
        return 1
    return 0


def _hold_exit_for_jit(exc: BaseException) -> None:
    """--jit-ckpt: a survivor whose collective failed because a peer died stays until it has saved (bounded)."""
    bound = os.environ.get("NVRX_JIT_CKPT")
    if bound and "nvrx.launcher.rank.jit_link" in sys.modules:
        from nvrx.launcher.rank import jit_link

        jit_link.hold_exit(exc, float(bound) + 1.0)


def flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _die_by_signal(signum: int) -> NoReturn:
    """Finish like python does after an uncaught KeyboardInterrupt: clean shutdown, then the signal."""
    _join_non_daemon_threads()
    atexit._run_exitfuncs()
    _flush_open_files()
    flush_stdio()
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # only if the signal did not end us


def _join_non_daemon_threads() -> None:
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def _flush_open_files() -> None:
    """Flush every open Python file object, as interpreter teardown would when it frees them."""
    for obj in gc.get_objects():  # after the fork server's gc.freeze() this is only the user's objects
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:
                pass


def exit_with(code: int) -> NoReturn:
    """End the rank the way python ends: threads joined, atexit handlers run, buffers flushed.

    The interpreter's own teardown of a process that imported torch costs 0.2-0.6 s and does nothing
    the user can observe beyond what is done here, so it is skipped (a rank's exit is on the restart
    and shutdown path). NVRX_FULL_EXIT=1 (set by `nvrx launch --no-fast-exit`) keeps the full teardown.
    """
    if code < 0:
        _die_by_signal(-code)
    if os.environ.get(FULL_EXIT_ENV) == "1":
        flush_stdio()
        sys.exit(code)
    _join_non_daemon_threads()
    atexit._run_exitfuncs()
    _flush_open_files()
    flush_stdio()
    os._exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else list(argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -P -m nvrx.launcher.rank.bootstrap [-m MODULE | SCRIPT] [ARGS...]\n")
        sys.exit(2)
    exit_with(run_user_code(argv[0], argv[1:], module))


if __name__ == "__main__":
    main()
