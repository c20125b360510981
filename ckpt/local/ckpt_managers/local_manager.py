"""``LocalCheckpointManager``: frequent checkpoints on node-local storage, each rank's shard replicated to ranks
on other nodes, so losing a node's files loses no shard.

Layout: ``<root>/<session_id>/rank<R>/iter_<I:09d>_<owner>_local.nvrxl``: what rank R holds, its own shard and the
replicas of its clique's other members. Files are written atomically with CRC-32s (``codec``) in 0700
directories; nothing is pickled. Save: snapshot (pack) -> replicate (collective in the clique) -> write (here or
in a thread for ``is_async``) -> one all-gather "written everywhere?" -> only then are other iterations removed,
so a crash at any point leaves the previous complete iteration. ``find_latest`` verifies every file, gathers
what each rank holds and picks the newest iteration whose every shard has an intact copy somewhere it can come
from; ``load`` fetches the shards that are not local from a replica holder.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ckpt.async_ckpt.dist_wrapper import DistWrapper
from ckpt.local.base_state_dict import TensorAwareStateDict
from ckpt.local.basic_state_dict import BasicTensorAwareStateDict
from ckpt.local.codec import Packed, pack, read_file, seal, unpack, verify_file, write_file
from ckpt.local.errors import LocalCheckpointCorruptError, LocalCheckpointError, NoReplicasAvailableError
from ckpt.local.replication.strategies import CliqueReplicationStrategy, ReplicationStrategy
from nvrx_common.files import private_dir

log = logging.getLogger(__name__)

SUFFIX = ".nvrxl"
_ID = re.compile(r"^iter_(\d{9})_(\d+)_local$")
_HEADROOM = 1 << 20


def ckpt_id(iteration: int, rank: int) -> str:
    """The id of rank RANK's shard of ITERATION (also its file name, without the suffix)."""
    return f"iter_{iteration:09d}_{rank}_local"


def parse_id(id_: str) -> tuple[int, int] | None:
    """(iteration, owner rank) of ID_, or None if it is not a local checkpoint id."""
    m = _ID.match(id_)
    return (int(m.group(1)), int(m.group(2))) if m else None


def newest_restorable(available: Mapping[int, Sequence[str]], sources: Sequence[Sequence[int]]) -> tuple[int, list[str]]:
    """The newest iteration whose shard of every rank r is held by one of SOURCES[r] (the ranks r can fetch from:
    itself, and its clique with replication), and why each newer iteration was skipped. -1 if none."""
    iterations = sorted({p[0] for ids in available.values() for p in map(parse_id, ids) if p}, reverse=True)
    skipped = []
    for it in iterations:
        missing = [r for r, srcs in enumerate(sources)
                   if not any(ckpt_id(it, r) in available.get(h, ()) for h in srcs)]
        if not missing:
            return it, skipped
        skipped.append(f"iteration {it}: no intact copy (own file or replica) of the shard of rank(s) {missing}")
    return -1, skipped


def _check_private(path: Path) -> None:
    """Refuse a directory another user could write or read: our files there are loaded back."""
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise LocalCheckpointError(f"local checkpoint directory {path} is not private (owner uid {st.st_uid}, mode "
                                   f"{stat.S_IMODE(st.st_mode):04o}); it must be yours and 0700: chmod 700 it or "
                                   "choose another root_local_ckpt_dir / session_id")


@dataclass
class LocalSaveRequest:
    """A local save after its snapshot: checksum, replication exchange (the clique's own process group) and file
    writes, run inline or by a thread (``is_async``). The manager finalizes it (a collective on the world group)
    at its next ``save`` / ``find_latest`` / ``wait``; errors are recorded, not raised, so every rank agrees."""

    iteration: int
    mine: Packed
    strategy: ReplicationStrategy | None
    directory: Path
    files: list[Path] = field(default_factory=list)
    error: str | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def _replicas(self) -> list[Packed]:
        if self.strategy is None:
            return []
        if isinstance(self.strategy, CliqueReplicationStrategy):
            return self.strategy.replicate_packed(self.mine)
        got, ids = self.strategy.replicate(unpack(self.mine, verify=False), self.mine.id)
        return [pack(sd, i) for sd, i in zip(got, ids)]

    def run(self) -> None:
        """Checksum, replicate, check free space, write every file (own shard first, then the replicas)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            packs = [seal(self.mine), *self._replicas()]
            need = sum(p.payload.numel() for p in packs) + _HEADROOM
            free = shutil.disk_usage(self.directory).free
            if free < need:
                raise OSError(28, f"not enough space: need {need} bytes, {free} free")
            for p in packs:
                path = self.directory / f"{p.id}{SUFFIX}"
                self.files.append(path)
                write_file(path, p)
        except OSError as exc:
            self.error = f"rank {rank}: {exc.strerror or exc} in {self.directory}"
        except Exception as exc:  # noqa: BLE001 - a thread must hand every failure to the agreement, not die
            self.error = f"rank {rank}: {type(exc).__name__}: {exc}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="nvrx-local-ckpt-write", daemon=False)
        self._thread.start()

    def is_done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait_local(self) -> None:
        if self._thread is not None:
            self._thread.join()


class LocalCheckpointManager:
    """Local checkpoints under ROOT_LOCAL_CKPT_DIR/SESSION_ID, replicated by REPL_STRATEGY (None: no replicas).

    Every method except the constructor is collective: all ranks call it at the same point of the program.
    """

    def __init__(self, root_local_ckpt_dir: str | os.PathLike, session_id: str | None = None,
                 repl_strategy: ReplicationStrategy | None = None) -> None:
        self._dist = DistWrapper()
        self.rank, self.world_size = self._dist.rank, self._dist.world_size
        self.session_dir = Path(root_local_ckpt_dir) / (session_id or "default")
        self.local_dir = self.session_dir / f"rank{self.rank}"
        try:
            private_dir(self.local_dir)
        except OSError as exc:
            raise LocalCheckpointError(f"cannot create local checkpoint directory {self.local_dir}: "
                                       f"{exc.strerror or exc}; choose a writable root_local_ckpt_dir") from None
        _check_private(self.session_dir)
        _check_private(self.local_dir)
        self.repl_strategy = repl_strategy
        self._pending: LocalSaveRequest | None = None
        self._found: tuple[int, dict[int, list[str]], list[str]] | None = None
        self._sources: list[list[int]] | None = None
        self._spare: torch.Tensor | None = None
        self._verified: dict[str, tuple[int, int, int, int]] = {}  # id -> file identity when find_latest checked it
        self.last_load_source: str | None = None

    # --- save ------------------------------------------------------------------------------------------------

    def _strategy(self) -> ReplicationStrategy | None:
        s = self.repl_strategy
        return getattr(s, "replication_strategy", s) if s is not None else None

    def path_of(self, id_: str) -> Path:
        return self.local_dir / f"{id_}{SUFFIX}"

    def _read(self, id_: str) -> Packed:
        """The verified file of ID_; a vanished or unreadable file is a LocalCheckpointError like a damaged one."""
        try:
            return read_file(self.path_of(id_), trusted=self._verified.get(id_))
        except OSError as exc:
            raise LocalCheckpointError(f"cannot read {self.path_of(id_)}: {exc.strerror or exc}") from None

    def save(self, state_dict: TensorAwareStateDict | dict[str, Any], iteration: int,
             is_async: bool = False) -> LocalSaveRequest | None:
        """Save this rank's STATE_DICT as ITERATION. The tensors are copied before this returns (later changes do
        not leak into the checkpoint); with IS_ASYNC the files are written in the background and the save is
        finalized at the next call; the checksum and the replication exchange run there too, so training is
        blocked only for the copy. Raises LocalCheckpointError on every rank if any rank failed to write
        (the previous local checkpoint is kept, training can go on)."""
        if iteration < 0:
            raise LocalCheckpointError(f"iteration must be >= 0, got {iteration}")
        self._finalize_pending()
        if isinstance(state_dict, TensorAwareStateDict) and not isinstance(state_dict, BasicTensorAwareStateDict):
            raise LocalCheckpointError(f"{type(state_dict).__name__} cannot be saved without pickling; pass a dict or "
                                       "a BasicTensorAwareStateDict")
        strategy = self._strategy()  # a lazy strategy makes its groups here, on the training thread (collective)
        spare, self._spare = self._spare, None
        mine = pack(state_dict, ckpt_id(iteration, self.rank), out=spare, checksum=False)
        self._found = None
        request = LocalSaveRequest(iteration, mine, strategy, self.local_dir)
        if is_async:
            request.start()
            self._pending = request
            return request
        request.run()
        self._finish(request)
        return None

    def _finalize_pending(self) -> None:
        request, self._pending = self._pending, None
        if request is not None:
            request.wait_local()
            self._finish(request)

    def wait(self) -> None:
        """Finalize a pending asynchronous save (collective)."""
        self._finalize_pending()

    def _finish(self, request: LocalSaveRequest) -> None:
        """Agree the save is written everywhere; only then remove every other iteration from this rank's dir."""
        errors = [e for e in self._dist.all_gather_json(request.error) if e]
        self._spare = request.mine.buffer  # written everywhere or abandoned: the next snapshot may reuse it
        if errors:
            for path in request.files:
                path.unlink(missing_ok=True)
            raise LocalCheckpointError(f"local checkpoint of iteration {request.iteration} failed ({'; '.join(errors)}); "
                                       "the previous local checkpoint is kept")
        keep = {path.name for path in request.files}
        for path in self.local_dir.iterdir():
            if path.name not in keep:
                path.unlink(missing_ok=True)
        log.debug("local checkpoint %d complete on all ranks", request.iteration)

    # --- find / load -----------------------------------------------------------------------------------------

    def _scan(self) -> list[str]:
        """Ids of this rank's intact files (every byte checked); removes leftovers of interrupted writes and
        moves corrupt files aside (logged) so no plan counts on them."""
        ids = []
        self._verified = {}
        for path in sorted(self.local_dir.iterdir()):
            if ".tmp-" in path.name and path.name.startswith("."):
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX) or parse_id(path.name[: -len(SUFFIX)]) is None:
                continue
            try:
                _, identity = verify_file(path)
            except (LocalCheckpointCorruptError, OSError, ValueError) as exc:
                log.warning("local checkpoint file is damaged, not used: %s", exc)
                path.rename(path.with_name(f".corrupt-{path.name}"))
                continue
            ids.append(path.name[: -len(SUFFIX)])
            self._verified[ids[-1]] = identity
        return ids

    def _restore_sources(self) -> list[list[int]]:
        """For each rank, the ranks it can get its shard from (itself; with replication its whole clique)."""
        if self._sources is None:
            strategy = self._strategy()
            mine = list(strategy.group_ranks) if isinstance(strategy, CliqueReplicationStrategy) else [self.rank]
            self._sources = [list(g) for g in self._dist.all_gather_json(mine)]
        return self._sources

    def find_latest(self) -> int:
        """The newest iteration every rank can restore (from its files or replicas), agreed by all; -1 if none."""
        self._finalize_pending()
        available = {r: ids for r, ids in enumerate(self._dist.all_gather_json(self._scan()))}
        iteration, skipped = newest_restorable(available, self._restore_sources())
        if self.rank == 0:
            for reason in skipped:
                log.warning("local checkpoint %s; trying an older one", reason)
        self._found = (iteration, available, skipped)
        return iteration

    def load(self) -> tuple[TensorAwareStateDict, str]:
        """This rank's shard of the iteration ``find_latest`` found, and its id. Shards not held locally come from a
        replica holder. NoReplicasAvailableError if some shard has no copy left (restore from the global tier)."""
        if self._found is None:
            self.find_latest()
        iteration, available, skipped = self._found
        if iteration < 0:
            if skipped:
                raise NoReplicasAvailableError(f"no local checkpoint can be restored ({skipped[0]}); "
                                               "restore from the global checkpoint tier")
            raise LocalCheckpointError(f"no local checkpoint in {self.session_dir}")
        id_ = ckpt_id(iteration, self.rank)
        strategy = self._strategy()
        if strategy is None:
            packed = self._read(id_)
        else:
            wanted = [ckpt_id(iteration, r) for r in strategy.group_ranks]
            plan = strategy.retrieve_plan(available, wanted)
            packed = strategy.retrieve_execute(plan, self._read)
        self.last_load_source = "own file" if id_ in available.get(self.rank, ()) else "replica"
        state = unpack(packed, verify=False)
        if torch.cuda.is_available():
            state.restore_tensor_device()
        return state, id_


LOCAL_CKPT_DIR_ENV = "NVRX_LOCAL_CKPT_DIR"


def default_root() -> Path:
    """Where local checkpoints go when the script does not say: ``nvrx launch --local-ckpt-dir`` (NVRX_LOCAL_CKPT_DIR),
    else ``$SLURM_TMPDIR/nvrx-local-ckpt``, else ``/dev/shm/nvrx-local-ckpt-<uid>`` (node-local, memory speed)."""
    if os.environ.get(LOCAL_CKPT_DIR_ENV):
        return Path(os.environ[LOCAL_CKPT_DIR_ENV])
    if os.environ.get("SLURM_TMPDIR"):
        return Path(os.environ["SLURM_TMPDIR"]) / "nvrx-local-ckpt"
    return Path("/dev/shm") / f"nvrx-local-ckpt-{os.getuid()}"
