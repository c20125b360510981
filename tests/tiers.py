"""The suite's tiers and the rules for running it in parallel (a pytest plugin, registered by tests/conftest.py).

Every test has exactly one tier (docs/development.md, "Testing"):
  unit         no process started, no socket opened: pure functions, parsers, state machines
  integration  real processes on this host: a rank monitor, a worker group, a rendezvous, two ranks, the CLI
  e2e          whole jobs: `nvrx launch` / `nvrx resume` / torchrun running a training script, Slurm, emulated hosts

A test's tier is its own marker if it has one (the nearest wins: test, class, module); else its file's own entry
in TIER_BY_PATH; else e2e if it uses a fixture that runs whole jobs (JOB_FIXTURES: `launcher`, the fault matrix's
`job`); else the tier of the longest directory entry of TIER_BY_PATH its path (under tests/) starts with. So a new
test in an existing directory needs nothing. Collection fails, naming the tests, when a test has no tier or two at the same level.
The unit tier is also checked while it runs: a unit test that starts a process or opens a socket fails, saying
which tier it belongs to (``--tier-audit FILE`` records, for every test, what it started instead).

For parallel runs (pytest-xdist, ``--dist loadgroup``): tests whose path is in GROUP_BY_PATH run in one worker
(the Slurm tests share one test Slurm per worker, and two would fight over its cgroups and node names); tests
marked ``alone`` run while no other test of the session runs (a lock every worker takes, shared or exclusive).
Items are ordered e2e, integration, unit, so the long tests start first and the short ones fill the end.
"""

from __future__ import annotations

import _posixsubprocess
import fcntl
import json
import os
import re
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

TESTS_DIR = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e")
TIER_ORDER = {"e2e": 0, "integration": 1, "unit": 2}  # the order tests are handed out in

# The tier of a test without a tier marker: the longest prefix of its path relative to tests/ that matches.
# A new file in a listed directory takes the directory's tier; a file whose tests all belong elsewhere gets its
# own line; single tests that differ from their file carry the marker themselves.
TIER_BY_PATH: dict[str, str] = {
    "unit/": "unit",
    "integration/": "integration",
    "slurm/": "e2e",
    "faults/": "e2e",
    "hosts_e2e/": "e2e",  # whole jobs on emulated hosts (tests/hosts.py)
    "ckpt/": "integration",
    "compat/": "integration",
    "inprocess/": "integration",
    "rerun/": "integration",
    "straggler/": "integration",
    # files whose tests run whole jobs (nvrx launch / torchrun with a script), in directories named by topic
    "ckpt/test_launch_async_ckpt.py": "e2e",
    "ckpt/local/test_launch_local_dir.py": "e2e",
    "ckpt/local/test_node_loss.py": "e2e",
    "ckpt/local/test_two_tiers.py": "e2e",
    "inprocess/test_launch_inprocess.py": "e2e",
    "integration/test_launch_bad_input.py": "integration",  # launches that end at the flags
    "integration/test_graceful_stop.py": "e2e",
    "integration/test_inspect.py": "e2e",
    "integration/test_inspect_runs.py": "e2e",
    "integration/test_launch.py": "e2e",
    "integration/test_launch_monitors.py": "e2e",
    "integration/test_process_title.py": "e2e",
    "integration/test_rendezvous_auth.py": "e2e",
    "integration/test_template_warmup.py": "e2e",
    "integration/test_user_world.py": "e2e",
    "integration/test_worker_env.py": "e2e",
    "rerun/test_launch_rerun.py": "e2e",
    "rerun/test_launch_rerun_hosts.py": "e2e",
    "rerun/test_resume_record.py": "e2e",
    "straggler/test_launch.py": "e2e",
    # files in tests/unit whose every test starts a process (nvrx inspect, a health hook)
    "unit/test_inspect_bad_inputs.py": "integration",
    "unit/test_inspect_view.py": "integration",
    "unit/test_node_health_hook_group.py": "integration",  # runs the hook as a process group
    # files of pure functions and state machines (no process, no socket: checked) outside tests/unit
    "faults/test_table.py": "unit",
    "inprocess/test_atomic.py": "unit",
    "inprocess/test_components.py": "unit",
    "rerun/test_exit_note.py": "unit",
    "rerun/test_machine.py": "unit",
    "rerun/test_megatron_api.py": "unit",
    "straggler/test_scoring.py": "unit",
}

# Fixtures that run `nvrx launch` jobs: a test using one is e2e unless its file or itself says otherwise.
JOB_FIXTURES = frozenset({"launcher", "job", "host_job"})

# Tests that must share one xdist worker (one group each): the test Slurm is a session fixture per worker.
GROUP_BY_PATH: dict[str, str] = {
    "slurm/": "slurm",
    # emulated hosts (network namespaces, a bridge each, agents in them): one worker at a time, not beside Slurm's
    "hosts_e2e/": "netns",
    "faults/test_partitions.py": "netns",
    "ckpt/local/test_node_loss.py": "netns",
    "rerun/test_launch_rerun_hosts.py": "netns",
}

# What a unit test may not do: the audit events of starting a process or opening a socket (multiprocessing's
# spawn/forkserver start their process through _posixsubprocess.fork_exec, which has no audit event: wrapped below).
FORBIDDEN_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system",
                              "os.exec", "socket.__new__"})

_TIER_KEY = pytest.StashKey[str]()


# ------------------------------------------------------------------------------------------------ tier lookup

def _table_entry(path: Path) -> tuple[str, str] | None:
    """(longest TIER_BY_PATH key covering PATH, its tier), or None."""
    try:
        rel = path.resolve().relative_to(TESTS_DIR).as_posix()
    except ValueError:
        return None
    best = max((p for p in TIER_BY_PATH if rel.startswith(p)), key=len, default=None)
    return (best, TIER_BY_PATH[best]) if best else None


def tier_from_path(path: Path) -> str | None:
    """The tier TIER_BY_PATH gives a test file, or None when no entry covers it."""
    entry = _table_entry(path)
    return entry[1] if entry else None


def resolve_tier(item: pytest.Item) -> tuple[str | None, str]:
    """(tier, "") or (None, why not): the nearest node's tier marker, else the file's own table entry, else e2e
    for a test using a job fixture, else the directory's table entry."""
    for node in reversed(item.listchain()):
        found = sorted({m.name for m in node.own_markers if m.name in TIERS})
        if len(found) > 1:
            return None, f"has two tier markers ({', '.join(found)}) on {node.nodeid or node.name}: keep one"
        if found:
            return found[0], ""
    entry = _table_entry(item.path)
    if entry and entry[0].endswith(".py"):
        return entry[1], ""
    if JOB_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "e2e", ""
    if entry is None:
        return None, ("has no tier: mark it (pytest.mark.unit / integration / e2e) or add its directory to "
                      "TIER_BY_PATH in tests/tiers.py")
    return entry[1], ""


def item_tier(item: pytest.Item) -> str:
    return item.stash[_TIER_KEY]


def group_from_path(path: Path) -> str | None:
    try:
        rel = path.resolve().relative_to(TESTS_DIR).as_posix()
    except ValueError:
        return None
    best = max((p for p in GROUP_BY_PATH if rel.startswith(p)), key=len, default=None)
    return GROUP_BY_PATH[best] if best else None


# ------------------------------------------------------------------------------------------- package selection

_SOURCE_CACHE: dict[Path, str] = {}
# Tests of the launcher that name no nvrx.launcher module: they run `nvrx launch` through these helpers.
_LAUNCHER_HINT = re.compile(r"\b(Launcher|launcher|FaultJob|job)\b")


def belongs_to(path: Path, package: str) -> bool:
    """Whether the test file at PATH tests nvrx package PACKAGE ('launcher', 'ckpt', 'launcher.agent', ...): its
    file names ``nvrx.PACKAGE`` (an import or a module started by name), or it sits in tests/<last part of
    PACKAGE>/, or (for the launcher) it runs `nvrx launch` through the Launcher helpers."""
    package = package.removeprefix("nvrx.").strip(".")
    try:
        dirs = path.resolve().relative_to(TESTS_DIR).parts[:-1]
    except ValueError:
        dirs = ()
    if package.split(".")[-1] in dirs:
        return True
    if path not in _SOURCE_CACHE:
        _SOURCE_CACHE[path] = path.read_text(errors="replace")
    text = _SOURCE_CACHE[path]
    if re.search(r"\bnvrx\." + re.escape(package) + r"\b", text):
        return True
    return package.split(".")[0] == "launcher" and _LAUNCHER_HINT.search(text) is not None


# ---------------------------------------------------------------------------------------------- the unit guard

class _Guard:
    """What the running test may do. One per process: pytest runs one test at a time in it."""

    def __init__(self) -> None:
        self.forbid = False       # the running test is a unit test
        self.record = False       # --tier-audit: note everything, forbid nothing
        self.seen: list[str] = []
        self.lock = threading.Lock()

    def check(self, event: str, detail: str) -> None:
        if not (self.forbid or self.record):
            return
        with self.lock:
            self.seen.append(f"{event} {detail}".strip())
        if self.forbid:
            raise TierViolation(f"a unit test may not start a process or open a socket ({event} {detail}); give "
                                "it the integration tier (pytest.mark.integration, or move it to tests/integration)")


class TierViolation(RuntimeError):
    """A unit test started a process or opened a socket."""


GUARD = _Guard()


def _describe(event: str, args: tuple) -> str:
    if event == "subprocess.Popen" and len(args) > 1:
        argv = args[1]
        return " ".join(map(str, argv)) if isinstance(argv, (list, tuple)) else str(argv)
    if event == "socket.__new__" and len(args) > 1:
        return f"family={args[1]}"
    if event in ("os.system", "os.posix_spawn", "os.exec") and args:
        return str(args[0] if event == "os.system" else args[1] if len(args) > 1 else args[0])[:300]
    return ""


def _audit(event: str, args: tuple) -> None:
    if event in FORBIDDEN_EVENTS and (GUARD.forbid or GUARD.record):
        detail = _describe(event, args)
        GUARD.check(event, detail if len(detail) <= 200 else detail[:200] + "...")


_real_fork_exec = _posixsubprocess.fork_exec


def _guarded_fork_exec(*args, **kwargs):
    if GUARD.forbid or GUARD.record:
        argv = args[1] if len(args) > 1 else ()
        GUARD.check("_posixsubprocess.fork_exec", " ".join(os.fsdecode(a) for a in argv or ())[:200])
    return _real_fork_exec(*args, **kwargs)


sys.addaudithook(_audit)
_posixsubprocess.fork_exec = _guarded_fork_exec


# ------------------------------------------------------------------------------------------------ the 'alone' lock

class AloneLock:
    """A readers-writer lock between the xdist workers of one session: every test holds it shared, an
    ``alone`` test exclusively. A turnstile keeps waiting exclusive takers from starving."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._gate = os.open(directory / "nvrx-alone.gate", os.O_RDWR | os.O_CREAT, 0o600)
        self._run = os.open(directory / "nvrx-alone.run", os.O_RDWR | os.O_CREAT, 0o600)

    @contextmanager
    def held(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._run, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(self._gate, fcntl.LOCK_UN)


def _session_dir(config: pytest.Config) -> Path | None:
    """A directory the workers of this xdist session share (the controller's basetemp), or None without xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return None
    return Path(factory.getbasetemp()).parent


# ------------------------------------------------------------------------------------------------------- hooks

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvrx", "nvrx test suite")
    group.addoption("--package", action="append", default=[], metavar="NAME",
                    help="only tests of nvrx package NAME (launcher, ckpt, monitors, launcher.agent, ...): their file "
                         "names nvrx.NAME or sits in tests/NAME/ (repeatable)")
    group.addoption("--tier-audit", default=None, metavar="FILE",
                    help="run every tier unguarded and write, per test, the processes and sockets it started to "
                         "FILE (JSON lines)")


def pytest_configure(config: pytest.Config) -> None:
    declared = {line.split(":")[0].strip() for line in config.getini("markers")}
    for name in (*TIERS, "alone"):
        if name not in declared:  # pyproject.toml declares them; a run with another ini file still knows them
            config.addinivalue_line("markers", f"{name}: see tests/tiers.py")
    config.stash[_ALONE_KEY] = None


_ALONE_KEY = pytest.StashKey["AloneLock | None"]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every item its tier (failing collection when one has none or two), its xdist group, the package
    filter, and the order: e2e, integration, unit (stable within a tier)."""
    problems = []
    for item in items:
        tier, why = resolve_tier(item)
        if tier is None:
            problems.append(f"  {item.nodeid} {why}")
            continue
        item.stash[_TIER_KEY] = tier
        if not any(m.name == tier for m in item.iter_markers()):
            item.add_marker(tier)
        group = group_from_path(item.path)
        if group and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if problems:
        raise pytest.UsageError("every test needs exactly one tier (unit, integration, e2e; tests/tiers.py):\n"
                                + "\n".join(problems))
    packages = config.getoption("package")
    if packages:
        keep = [it for it in items if any(belongs_to(it.path, p) for p in packages)]
        dropped = [it for it in items if it not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    items.sort(key=lambda it: TIER_ORDER[item_tier(it)])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Hold the 'alone' lock (parallel runs) and arm the unit guard for the whole test: setup, call, teardown."""
    config = item.config
    lock = config.stash.get(_ALONE_KEY, None)
    if lock is None:
        where = _session_dir(config)
        if where is not None:
            lock = AloneLock(where)
            config.stash[_ALONE_KEY] = lock
    audit = config.getoption("tier_audit")
    GUARD.seen = []
    GUARD.record = bool(audit)
    GUARD.forbid = not audit and item.stash.get(_TIER_KEY, None) == "unit"
    held = lock.held(item.get_closest_marker("alone") is not None) if lock is not None else None
    if held is not None:
        held.__enter__()
    try:
        yield
    finally:
        GUARD.forbid = GUARD.record = False
        if held is not None:
            held.__exit__(None, None, None)
        if audit:
            with open(audit, "a") as fh:
                fh.write(json.dumps({"nodeid": item.nodeid, "tier": item.stash.get(_TIER_KEY, None),
                                     "events": GUARD.seen}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    """Not during teardown: it also finalizes fixtures of wider scope whose last user this test was (a module's or
    the session's test Slurm stops there, running squeue), and those processes are not the unit test's."""
    forbid, GUARD.forbid = GUARD.forbid, False
    try:
        yield
    finally:
        GUARD.forbid = forbid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """A unit test that swallowed the guard's exception still fails."""
    outcome = yield
    report = outcome.get_result()
    # the tier travels with the report (also to the xdist controller): keywords cannot tell it, they hold the
    # path's directory names too (tests/integration/ holds e2e tests)
    report.user_properties.append(("tier", item.stash.get(_TIER_KEY, None)))
    report.user_properties.append(("slow", item.get_closest_marker("slow") is not None))
    if report.when == "call" and report.passed and GUARD.forbid and GUARD.seen:
        report.outcome = "failed"
        report.longrepr = (f"unit test started a process or opened a socket: {GUARD.seen[0]}; give it the "
                           "integration tier")
