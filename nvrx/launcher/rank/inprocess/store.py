"""The Wrapper's distributed store: the records all ranks share (barriers, faults, terminated ranks,
heartbeats) on top of any ``torch.distributed.Store``.

``StoreMixin`` adds those records to a store class; ``TCPStore`` is the default. A custom store
subclasses ``StoreMixin`` and a torch store class and is passed as ``store_factory``. The monitor
process and the monitor thread open their own connections from ``client_spec()``: a JSON-able
``{"factory": "module:Class", "kwargs": {...}}`` (nothing is pickled between processes).

Values are JSON text. Keys live under ``nvrx_inprocess/<session>/`` so one store can serve several
Wrapper calls (and an agent's store can host them next to its own keys).
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import threading
from typing import Any, Iterable

import torch.distributed as dist

from nvrx.launcher.rank.inprocess.exceptions import ConfigurationError, StoreUnavailable

log = logging.getLogger(__name__)
_hosting_warned = threading.Event()  # (the store is made again for every call of the wrapped function)

PREFIX = "nvrx_inprocess"
DEFAULT_TIMEOUT = 300.0


def first_line(exc: BaseException) -> str:
    """The first line of EXC's message (torch errors append C++ traces), or its type's name."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def factory_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def load_factory(path: str) -> Any:
    """Import ``module:Qual.Name``."""
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_TIMEDELTA = "__timedelta_seconds__"


def encode_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Store factory KWARGS as JSON-able values: ``timedelta``s (NVRx's examples pass them) become tagged
    seconds, so the monitor process can rebuild exactly what the rank's factory received."""
    return {k: {_TIMEDELTA: v.total_seconds()} if isinstance(v, datetime.timedelta) else v for k, v in kwargs.items()}


def decode_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``encode_kwargs``."""
    return {k: datetime.timedelta(seconds=v[_TIMEDELTA]) if isinstance(v, dict) and set(v) == {_TIMEDELTA} else v
            for k, v in kwargs.items()}


def unreachable_class(cls: type) -> str | None:
    """Why the monitor process (its own interpreter) could not import store class CLS by name, or None."""
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        where = "the main script" if cls.__module__ == "__main__" else "a function"
        return (f"store class {cls.__qualname__} is defined in {where}; the in-process monitor process, a "
                "separate interpreter, opens its own store connection by importing the class: define it at the "
                "top level of a module")
    return None


def store_from_spec(spec: dict[str, Any]) -> "StoreMixin":
    store = load_factory(spec["factory"])(**decode_kwargs(spec.get("kwargs", {})))
    store.use_session(spec.get("session", "0"))
    return store


class StoreMixin:
    """The Wrapper's records, built from the base store's set/get/add/check/compare_set/append."""

    _ns = f"{PREFIX}/0/"
    _session = "0"
    _factory_kwargs: dict[str, Any] = {}
    _hosting = False  # this process runs the store's server (it must outlive the others' last reads)

    # ------------------------------------------------------------ naming and connections

    def use_session(self, session: str) -> None:
        self._session = str(session)
        self._ns = f"{PREFIX}/{session}/"

    def key(self, name: str) -> str:
        return self._ns + name

    def describe(self) -> str:
        host, port = getattr(self, "host", None), getattr(self, "port", None)
        return f"{host}:{port}" if host else type(self).__name__

    def client_spec(self) -> dict[str, Any]:
        """How another thread or process opens its own connection to this store (JSON-able)."""
        return {"factory": factory_path(type(self)), "kwargs": encode_kwargs(self._factory_kwargs),
                "session": self._session}

    def new_client(self) -> "StoreMixin":
        return store_from_spec(self.client_spec())

    def errors_as_unavailable(self) -> "_Guard":
        return _Guard(self)

    # ------------------------------------------------------------ small helpers

    def _get_text(self, key: str) -> str | None:
        if not self.check([key]):  # type: ignore[attr-defined]
            return None
        return self.get(key).decode()  # type: ignore[attr-defined]

    def _lines(self, key: str) -> list[Any]:
        text = self._get_text(key)
        return [json.loads(line) for line in text.splitlines() if line] if text else []

    def _append_line(self, key: str, value: Any) -> None:
        self.append(key, json.dumps(value, separators=(",", ":")) + "\n")  # type: ignore[attr-defined]

    def counter(self, name: str) -> int:
        return int(self.add(self.key(name), 0))  # type: ignore[attr-defined]

    # ------------------------------------------------------------ faults

    def record_fault(self, rank: int, iteration: int, reason: str) -> int:
        """Tell every rank that something failed; returns the new fault count."""
        self._append_line(self.key("faults"), {"rank": rank, "iteration": iteration, "reason": reason})
        return int(self.add(self.key("fault_count"), 1))  # type: ignore[attr-defined]

    def fault_count(self) -> int:
        return self.counter("fault_count")

    def faults(self) -> list[dict[str, Any]]:
        return self._lines(self.key("faults"))

    # ------------------------------------------------------------ terminated ranks (initial numbering)

    def mark_terminated(self, ranks: Iterable[int], reason: str) -> None:
        for rank in sorted(set(ranks)):
            self._append_line(self.key("terminated"), {"rank": rank, "reason": reason})

    def terminated(self) -> frozenset[int]:
        return frozenset(int(entry["rank"]) for entry in self._lines(self.key("terminated")))

    def termination_reasons(self) -> dict[int, str]:
        return {int(e["rank"]): str(e["reason"]) for e in reversed(self._lines(self.key("terminated")))}

    # ------------------------------------------------------------ heartbeats (monitor processes)

    def heartbeat(self, rank: int) -> int:
        return int(self.add(self.key(f"hb/{rank}"), 1))  # type: ignore[attr-defined]

    def heartbeats(self, ranks: Iterable[int]) -> dict[int, int]:
        """Current heartbeat counters of RANKS (ranks that never beat are left out)."""
        keys = {rank: self.key(f"hb/{rank}") for rank in ranks}
        if keys and self.check(list(keys.values())):  # type: ignore[attr-defined]
            values = self.multi_get(list(keys.values()))  # type: ignore[attr-defined]
            return {rank: int(v) for rank, v in zip(keys, values)}
        return {rank: int(self.get(k)) for rank, k in keys.items() if self.check([k])}  # type: ignore[attr-defined]

    def mark_done(self) -> None:
        self.set(self.key("done"), "1")  # type: ignore[attr-defined]

    def is_done(self) -> bool:
        return bool(self.check([self.key("done")]))  # type: ignore[attr-defined]

    # ------------------------------------------------------------ barriers

    def arrive(self, barrier: str, rank: int, payload: Any, leading: bool) -> None:
        self._append_line(self.key(f"b/{barrier}/arrived"), [rank, payload])
        if leading:
            self.add(self.key(f"b/{barrier}/lead"), 1)  # type: ignore[attr-defined]
        self.add(self.key(f"b/{barrier}/count"), 1)  # type: ignore[attr-defined]

    def arrival_count(self, barrier: str) -> int:
        return self.counter(f"b/{barrier}/count")

    def leading_arrivals(self, barrier: str) -> int:
        return self.counter(f"b/{barrier}/lead")

    def arrivals(self, barrier: str) -> dict[int, Any]:
        return {int(rank): payload for rank, payload in self._lines(self.key(f"b/{barrier}/arrived"))}

    def decision(self, barrier: str) -> dict[str, Any] | None:
        text = self._get_text(self.key(f"b/{barrier}/decision"))
        return json.loads(text) if text else None

    def decide(self, barrier: str, decision: dict[str, Any]) -> dict[str, Any]:
        """Write DECISION unless another rank decided first; returns the decision that holds."""
        mine = json.dumps(decision, separators=(",", ":"), sort_keys=True)
        held = self.compare_set(self.key(f"b/{barrier}/decision"), "", mine)  # type: ignore[attr-defined]
        return json.loads(held)

    # ------------------------------------------------------------ per-iteration process-group store

    def publish_pg_store(self, iteration: int, host: str, port: int) -> None:
        self.set(self.key(f"pg/{iteration}"), json.dumps([host, port]))  # type: ignore[attr-defined]

    def pg_store(self, iteration: int) -> tuple[str, int] | None:
        text = self._get_text(self.key(f"pg/{iteration}"))
        if not text:
            return None
        host, port = json.loads(text)
        return str(host), int(port)


class _Guard:
    """``with store.errors_as_unavailable():`` turns a lost store into one clear StoreUnavailable."""

    def __init__(self, store: StoreMixin) -> None:
        self.store = store

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        lost = isinstance(exc, (dist.DistError, RuntimeError)) and not isinstance(exc, StoreUnavailable)
        if lost:
            raise StoreUnavailable(
                f"the in-process restart store at {self.store.describe()} is unreachable ({first_line(exc)}); "
                "it is hosted by rank 0 unless a launcher agent hosts it, so the job cannot continue without it"
            ) from None
        return False


def _env_int(env: dict[str, str] | os._Environ, name: str) -> int:
    value = env.get(name)
    if value is None or not value.strip().isdigit():
        raise ConfigurationError(f"{name}={value!r}: the in-process Wrapper needs the torchrun environment "
                                 "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); run under nvrx launch or torchrun")
    return int(value)


class TCPStore(StoreMixin, dist.TCPStore):
    """The default store: torch's TCPStore at MASTER_ADDR:MASTER_PORT.

    Under an agent that hosts a store there (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun,
    ``nvrx launch``) every rank is a client, and the store outlives any rank. Otherwise rank 0 hosts
    it, listening only on the address MASTER_ADDR names on its machine; losing rank 0 then ends the job.
    The wrapped function's own process group never uses this port: the Wrapper gives it a fresh store
    for every iteration.
    """

    def __init__(self, host_name: str | None = None, port: int | None = None, world_size: int | None = None,
                 timeout: float | datetime.timedelta = DEFAULT_TIMEOUT, wait_for_workers: bool = True,
                 multi_tenant: bool = False, use_libuv: bool = True, tcp_store_host_rank: int | None = None, *,
                 is_master: bool | None = None, use_agent_store: bool | None = None) -> None:
        """NVRx's arguments are accepted: ``timeout`` as seconds or a ``timedelta``; ``tcp_store_host_rank``
        (default 0) is the RANK that hosts the store. The host never waits for ``world_size`` clients
        (``wait_for_workers``): the Wrapper's initial barrier does that, with its own timeout;
        ``multi_tenant``/``use_libuv`` are torch's defaults here and need no choice."""
        del world_size, wait_for_workers, multi_tenant, use_libuv  # see the docstring
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        env = os.environ
        host = host_name or env.get("MASTER_ADDR") or ""
        if not host:
            raise ConfigurationError("MASTER_ADDR is not set: the in-process Wrapper needs the torchrun environment "
                                     "(or store_kwargs={'host_name': ..., 'port': ...})")
        port = int(port) if port is not None else _env_int(env, "MASTER_PORT")
        if use_agent_store is None:
            use_agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if is_master is None:
            host_rank = 0 if tcp_store_host_rank is None else int(tcp_store_host_rank)
            is_master = not use_agent_store and _env_int(env, "RANK") == host_rank
        self._factory_kwargs = {"host_name": host, "port": port, "timeout": float(timeout)}
        # a rank (not an agent) runs the server: it is replaced between calls of the wrapped function
        self.rank_hosted = not use_agent_store
        self.host_name = host
        td = datetime.timedelta(seconds=timeout)
        if is_master:
            self._serve(host, port, td)
        else:
            dist.TCPStore.__init__(self, host, port, is_master=False, timeout=td)

    def _serve(self, host: str, port: int, timeout: datetime.timedelta) -> None:
        from nvrx.common.net import bind_listen, local_bind_address

        addr = local_bind_address(host)
        if addr is None:
            raise ConfigurationError(f"MASTER_ADDR={host} is not an address of this machine, but rank 0 hosts the "
                                     "in-process store there; set MASTER_ADDR to rank 0's host")
        try:
            sock = bind_listen(addr, port)
        except OSError as exc:
            raise ConfigurationError(f"cannot listen on {addr}:{port} for the in-process store ({exc.strerror}); "
                                     "choose a free MASTER_PORT") from None
        try:
            dist.TCPStore.__init__(self, host, port, is_master=True, master_listen_fd=sock.fileno(),
                                   wait_for_workers=False, timeout=timeout)
        except Exception:
            sock.close()
            raise
        sock.detach()  # the store owns the descriptor now
        self._hosting = True
        if os.environ.get("NVRX_ROUND") is not None and not _hosting_warned.is_set():  # set by nvrx launch's agent
            _hosting_warned.set()
            log.warning("this rank hosts the in-process restart store (nvrx launch --master-port): if its process dies "
                        "the whole job ends; without --master-port the launcher's agent hosts the store and the job "
                        "survives")

    def client_spec(self) -> dict[str, Any]:
        kwargs = dict(self._factory_kwargs, is_master=False, use_agent_store=True)
        return {"factory": factory_path(TCPStore), "kwargs": kwargs, "session": self._session}

    def describe(self) -> str:
        return f"{self.host_name}:{self.port}"



class FileStore(StoreMixin, dist.FileStore):
    """NVRx's ``inprocess.store.FileStore``: torch's ``FileStore`` (one file every rank can reach, e.g. on a
    shared file system) with the Wrapper's records; no server, so no rank's loss takes the store with it.

    ``FileStore(file_name, world_size=-1)`` takes torch's arguments. The file is never removed by the store:
    torch removes it once ``world_size`` store objects on it have been closed, and the Wrapper's monitor
    thread and monitor process open connections of their own, which torch would count as ranks and so
    remove the file under ranks still using it. Give every job a fresh path (a file still holding an
    earlier job's keys would be read as this job's) and remove it when the job is done.
    """

    def __init__(self, file_name: str | os.PathLike[str], world_size: int = -1) -> None:
        path = os.fspath(file_name) if isinstance(file_name, (str, os.PathLike)) else None
        if not path:
            raise ConfigurationError(f"FileStore: file_name must be a path, not {file_name!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size == 0 or world_size < -1:
            raise ConfigurationError(f"FileStore: world_size must be a positive number of ranks or -1, "
                                     f"not {world_size!r}")
        dist.FileStore.__init__(self, path, -1)  # -1: torch never counts connections to remove the file
        self.path_name = path
        self._factory_kwargs = {"file_name": path, "world_size": world_size}
        if world_size > 0 and not _file_kept_said.is_set():
            _file_kept_said.set()
            log.warning("FileStore(%s, world_size=%d): the file is not removed when the ranks are done (the Wrapper's "
                        "own connections would be counted as ranks); remove it after the job", path, world_size)

    def describe(self) -> str:
        return f"file {self.path_name}"


_file_kept_said = threading.Event()  # FileStore says once per process that it keeps its file
