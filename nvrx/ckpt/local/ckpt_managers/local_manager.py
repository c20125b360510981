"""``LocalCheckpointManager``: frequent checkpoints on node-local storage, each rank's shard replicated to ranks
on other nodes, so losing a node's files loses no shard.

Layout: ``<root>/<session_id>/rank<R>/iter_<I:09d>_<owner>_local.nvrxl``: what rank R holds, its own shard and the
replicas of its clique's other members. Files are written atomically with CRC-32s (``codec``) in 0700
directories; nothing is pickled. Save: snapshot -> replicate (collective in the clique) -> write (here, or for
``is_async`` on this process's persistent checkpoint writer process: ``async_save``) -> one all-gather "written
everywhere?" -> only then are other iterations removed, so a crash at any point leaves the previous complete
iteration. ``find_latest`` checks every file's header and size, gathers what each rank holds and picks the newest
iteration whose every shard has a copy somewhere it can come from; ``load`` fetches the shards that are not local
from a replica holder, checking each payload's CRC-32 as it is read.

No split brain (nvrx/ckpt/fence.py): under ``nvrx launch`` each file's header carries its round's ``[launch, round]``
and every rank directory the lineage of rounds (``.nvrx_fence.json``: which iteration each round resumed from);
``find_latest`` merges the lineages of all ranks and passes over files from a branch the job left (written by a
round a later round had already left behind), and a save by such a round is refused everywhere.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist

from nvrx.ckpt import fence
from nvrx.ckpt.async_ckpt.dist_wrapper import DistWrapper
from nvrx.ckpt.async_ckpt.staging import StagingPool
from nvrx.ckpt.local.base_state_dict import TensorAwareStateDict
from nvrx.ckpt.local.basic_state_dict import BasicTensorAwareStateDict
from nvrx.ckpt.local.ckpt_managers.async_save import AsyncLocalSave, announce, staging_layout
from nvrx.ckpt.local.codec import Packed, check_file, fill, layout, pack, read_file, seal, unpack, write_file
from nvrx.ckpt.local.errors import LocalCheckpointCorruptError, LocalCheckpointError, NoReplicasAvailableError
from nvrx.ckpt.local.naming import SUFFIX, ckpt_id, parse_id
from nvrx.ckpt.local.replication.strategies import CliqueReplicationStrategy, ReplicationStrategy
from nvrx.common.checkpoint_report import report_checkpoint
from nvrx.common.files import private_dir

if TYPE_CHECKING:
    from nvrx.ckpt.async_ckpt.core import AsyncRequest

log = logging.getLogger(__name__)

_HEADROOM = 1 << 20
_LOAD_ATTEMPTS = 4  # each failed attempt moved a damaged copy aside


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


def fenced_out(gathered: Sequence[Sequence[Any]], lineage: list[tuple[int, int, int]]) -> tuple[dict[int, list[str]], list[str]]:
    """What each rank holds (GATHERED[r] = [ids, world sizes, keys of the ids, lineage]) without the files from a branch
    the job left (LINEAGE: nvrx/ckpt/fence.py), and one line per iteration passed over for that."""
    available: dict[int, list[str]] = {}
    left: dict[int, tuple[tuple[int, int], tuple[int, int, int]]] = {}
    for rank, (ids, _, keys, _) in enumerate(gathered):
        kept = available.setdefault(rank, [])
        for id_, raw in zip(ids, keys):
            parsed, key = parse_id(id_), fence.key_of(raw)
            entry = fence.left_branch(key, parsed[0], lineage) if parsed and key else None
            if entry is None:
                kept.append(id_)
            else:
                left.setdefault(parsed[0], (key, entry))  # type: ignore[index]
    notes = [f"iteration {it}: written by round {key[1]} after round {entry[1]} of the job resumed from "
             f"{'iteration ' + str(entry[2]) if entry[2] >= 0 else 'no local checkpoint'} (a node cut off from the "
             "job wrote it), never used" for it, (key, entry) in sorted(left.items(), reverse=True)]
    return available, notes


def _check_private(path: Path) -> None:
    """Refuse a directory another user could write or read: our files there are loaded back."""
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise LocalCheckpointError(f"local checkpoint directory {path} is not private (owner uid {st.st_uid}, mode "
                                   f"{stat.S_IMODE(st.st_mode):04o}); it must be yours and 0700: chmod 700 it or "
                                   "choose another root_local_ckpt_dir / session_id")


@dataclass
class LocalSaveRequest:
    """A synchronous local save after its snapshot: checksum, replication exchange (the clique's own process
    group) and file writes; errors are recorded, not raised, so every rank agrees on the outcome (``_finish``)."""

    iteration: int
    mine: Packed
    strategy: ReplicationStrategy | None
    directory: Path
    files: list[Path] = field(default_factory=list)
    error: str | None = None

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



class LocalCheckpointManager:
    """Local checkpoints under ROOT_LOCAL_CKPT_DIR/SESSION_ID, replicated by REPL_STRATEGY (None: no replicas).

    Every method except the constructor is collective: all ranks call it at the same point of the program.
    """

    def __init__(self, root_local_ckpt_dir: str | os.PathLike, session_id: str | None = None,
                 repl_strategy: ReplicationStrategy | None = None) -> None:
        self._dist = DistWrapper()
        self.rank, self.world_size = self._dist.rank, self._dist.world_size
        self.session_dir = Path(root_local_ckpt_dir) / (session_id or default_session())
        self.local_dir = self.session_dir / f"rank{self.rank}"
        try:
            private_dir(self.local_dir)
        except OSError as exc:
            raise LocalCheckpointError(f"cannot create local checkpoint directory {self.local_dir}: "
                                       f"{exc.strerror or exc}; choose a writable root_local_ckpt_dir") from None
        _check_private(self.session_dir)
        _check_private(self.local_dir)
        self.repl_strategy = repl_strategy
        self._pending_async: AsyncLocalSave | None = None
        self._pool = StagingPool(keep_free=1)  # staging memfds of asynchronous saves, reused save after save
        self._found: tuple[int, dict[int, list[str]], list[str]] | None = None
        self._sources: list[list[int]] | None = None
        self._spare: torch.Tensor | None = None
        self.last_load_source: str | None = None
        self.other_world_sizes: set[int] = set()  # world sizes of files found by the last scan that are not ours
        self._keys: dict[str, tuple[int, int] | None] = {}  # id -> [launch, round] of the round that wrote it (scan)
        self._taken: dict[int, float] = {}  # iteration -> when its state was taken (reported once it is complete)

    # --- save ------------------------------------------------------------------------------------------------

    def _strategy(self) -> ReplicationStrategy | None:
        s = self.repl_strategy
        return getattr(s, "replication_strategy", s) if s is not None else None

    def path_of(self, id_: str) -> Path:
        return self.local_dir / f"{id_}{SUFFIX}"

    def _read(self, id_: str) -> Packed:
        """The file of ID_, its payload's CRC-32 checked as it is read. A damaged file is moved aside (so the next
        ``find_latest`` does not count on it); a vanished or unreadable one is a LocalCheckpointError too."""
        path = self.path_of(id_)
        try:
            return read_file(path)
        except LocalCheckpointCorruptError as exc:
            log.warning("local checkpoint file is damaged, not used: %s", exc)
            path.rename(path.with_name(f".corrupt-{path.name}"))
            raise
        except OSError as exc:
            raise LocalCheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None

    def save(self, state_dict: TensorAwareStateDict | dict[str, Any], iteration: int,
             is_async: bool = False) -> "AsyncRequest | None":
        """Save this rank's STATE_DICT as ITERATION. The tensors are copied before this returns (later changes do
        not leak into the checkpoint). Synchronous: checksum, replication exchange and writes happen here; raises
        LocalCheckpointError on every rank if any rank failed to write (the previous local checkpoint is kept,
        training can go on). IS_ASYNC: returns an ``AsyncRequest`` whose files the persistent checkpoint writer
        process writes while the replication exchange runs on a thread; schedule it on an ``AsyncCallsQueue``
        (finalized there, collectively) or leave it to this manager (finalized by ``wait``, the next ``save`` or
        ``find_latest``). Training is blocked only for the copy (and a small size exchange in the clique)."""
        if iteration < 0:
            raise LocalCheckpointError(f"iteration must be >= 0, got {iteration}")
        self._finalize_pending()
        if isinstance(state_dict, TensorAwareStateDict) and not isinstance(state_dict, BasicTensorAwareStateDict):
            raise LocalCheckpointError(f"{type(state_dict).__name__} cannot be saved without pickling; pass a dict or "
                                       "a BasicTensorAwareStateDict")
        strategy = self._strategy()  # a lazy strategy makes its groups here, on the training thread (collective)
        self._found = None
        self._taken = {iteration: time.time()}
        if is_async:
            return self._save_async(state_dict, iteration, strategy)
        spare, self._spare = self._spare, None
        mine = pack(state_dict, ckpt_id(iteration, self.rank), out=spare, checksum=False)
        mine.header["world_size"] = self.world_size
        mine.header.update(fence.stamp())  # which round wrote it: the key find_latest checks against the lineage
        request = LocalSaveRequest(iteration, mine, strategy, self.local_dir)
        request.run()
        self._finish(request)
        return None

    # --- asynchronous saves (the persistent writer process) -----------------------------------------------

    def _save_async(self, state_dict: Any, iteration: int, strategy: ReplicationStrategy | None) -> "AsyncRequest":
        """Snapshot into staging, hand the writer its job, start the exchange; the request to finalize it."""
        from nvrx.ckpt.async_ckpt.core import AsyncRequest, WriterJob
        from nvrx.ckpt.async_ckpt.writer_process import default_writer

        header, tensors = layout(state_dict, ckpt_id(iteration, self.rank))
        header["world_size"] = self.world_size  # shards of another world size are not this job's (find_latest)
        header.update(fence.stamp())  # which round wrote it: the key find_latest checks against the lineage
        clique = strategy if isinstance(strategy, CliqueReplicationStrategy) else None
        given = self._user_replicas(strategy, state_dict, header["id"]) if strategy is not None and not clique else []
        head = json.dumps(header, separators=(",", ":")).encode()
        sizes = clique.exchange_sizes(len(head), header["payload_nbytes"]) if clique else [(len(head), header["payload_nbytes"])]
        me = clique.group_ranks.index(self.rank) if clique else 0
        offsets, total = staging_layout([n for _, n in sizes] + [p.payload.numel() for p in given], me)
        save = AsyncLocalSave(iteration, self._pool.acquire(max(total, 1)))
        view = save.staging.bytes_view()
        fill(header, tensors, view[: header["payload_nbytes"]])  # the snapshot: training may go on after this
        job = {"op": "local", "dir": str(self.local_dir), "need": total + _HEADROOM,
               "own": {"header": header, "off": 0, "nbytes": header["payload_nbytes"]},
               "replicas": len(offsets) - 1}
        writer = default_writer()
        job_id, pipe = save.submit(writer, job)
        for p, off in zip(given, offsets[len(sizes):]):  # a user strategy's replicas: staged and announced now
            view[off: off + p.payload.numel()].copy_(p.payload)
            announce(pipe, {"header": p.header, "off": off, "nbytes": p.payload.numel()})
        save.start_exchange(clique, head, sizes, offsets, me, pipe)
        save.job = WriterJob(job=job, buffer=save.staging, job_id=job_id, submitted_to=writer if job_id else None,
                             dist_wrapper=self._dist, on_result=save.record, on_failure=save.fail,
                             on_discard=partial(self._discard_async, save),
                             description=f"local iteration {iteration} in {self.local_dir}")
        if not job_id:
            save.job.deliver({"ok": False, "error": save.error})
        self._pending_async = save
        return AsyncRequest(save.job, (self.rank, None), [partial(self._finish_async, save)],
                            preload_fn=save.mark_scheduled)

    @staticmethod
    def _user_replicas(strategy: ReplicationStrategy, state_dict: Any, id_: str) -> list[Packed]:
        """Replicas by a strategy of the user's (its own replicate(), on the training thread), packed."""
        got, ids = strategy.replicate(BasicTensorAwareStateDict(state_dict) if isinstance(state_dict, dict)
                                      else state_dict, id_)
        return [pack(sd, i, checksum=False) for sd, i in zip(got, ids)]

    def _settle_async(self, save: AsyncLocalSave) -> bool:
        """Mark SAVE as handled and wait for its exchange thread; False if it was handled already."""
        if save.finalized:
            return False
        save.finalized = True
        if self._pending_async is save:
            self._pending_async = None
        save.join()
        return True

    def _finish_async(self, save: AsyncLocalSave) -> None:
        """Finalize an asynchronous save (collective): agree it is written everywhere, then remove older files."""
        if not self._settle_async(save):
            return
        errors = [e for e in self._dist.all_gather_json(save.error or fence.local_save_refused(self.local_dir)) if e]
        self._pool.release(save.staging)
        if errors:
            self._remove_iteration(save.iteration)
            raise LocalCheckpointError(f"local checkpoint of iteration {save.iteration} failed ({'; '.join(errors)}); "
                                       "the previous local checkpoint is kept")
        self._keep_only(set(save.files))
        self._complete(save.iteration)

    def _discard_async(self, save: AsyncLocalSave, remove_files: bool) -> None:
        """A queue dropped the save (its write failed on some rank): free the staging, remove its files."""
        if not self._settle_async(save):
            return
        self._pool.release(save.staging)
        if remove_files:
            self._remove_iteration(save.iteration)

    def _remove_iteration(self, iteration: int) -> None:
        for path in self.local_dir.iterdir():
            parsed = parse_id(path.name[: -len(SUFFIX)]) if path.name.endswith(SUFFIX) else None
            if parsed is not None and parsed[0] == iteration:
                path.unlink(missing_ok=True)

    def _keep_only(self, names: set[str]) -> None:
        for path in self.local_dir.iterdir():
            if path.name not in names and path.name != fence.FENCE_FILE:
                path.unlink(missing_ok=True)

    def _finalize_pending(self) -> None:
        save = self._pending_async
        if save is not None and not save.finalized:
            if save.scheduled:
                raise LocalCheckpointError(f"the local save of iteration {save.iteration} was scheduled on an "
                                           "AsyncCallsQueue and is not finalized yet: call "
                                           "maybe_finalize_async_calls(blocking=True) on that queue first")
            save.scheduled = True
            assert save.job is not None
            save.job.deliver(save.poll(block=True))  # this rank's write; a failure is recorded, not raised
            self._finish_async(save)
        self._pending_async = None

    def wait(self) -> None:
        """Finalize a pending asynchronous save (collective)."""
        self._finalize_pending()

    def maybe_finalize(self) -> bool:
        """Finalize the pending asynchronous save if it is written on every rank, without waiting for the writer
        (collective while a save of the manager's own is pending). True when no save is pending any more; False
        while one is still being written somewhere, or is held by the caller's AsyncCallsQueue."""
        save = self._pending_async
        if save is None or save.finalized:
            self._pending_async = None
            return True
        if save.scheduled or not self._dist.all_true(save.done()):
            return False
        self._finalize_pending()
        return True

    def close(self) -> None:
        """Finalize a pending save and free the staging memory (collective)."""
        self._finalize_pending()
        self._pool.close()

    def _finish(self, request: LocalSaveRequest) -> None:
        """Agree the save is written everywhere; only then remove every other iteration from this rank's dir."""
        errors = [e for e in self._dist.all_gather_json(request.error or fence.local_save_refused(self.local_dir)) if e]
        self._spare = request.mine.buffer  # written everywhere or abandoned: the next snapshot may reuse it
        if errors:
            for path in request.files:
                path.unlink(missing_ok=True)
            raise LocalCheckpointError(f"local checkpoint of iteration {request.iteration} failed ({'; '.join(errors)}); "
                                       "the previous local checkpoint is kept")
        self._keep_only({path.name for path in request.files})
        self._complete(request.iteration)

    def _complete(self, iteration: int) -> None:
        """ITERATION is written everywhere: report it to the rank's monitor (for `nvrx inspect`'s goodput)."""
        log.debug("local checkpoint %d complete on all ranks", iteration)
        report_checkpoint(iteration, "local", taken=self._taken.pop(iteration, None), path=str(self.local_dir))

    # --- find / load -----------------------------------------------------------------------------------------

    def _scan(self) -> list[str]:
        """Ids of this rank's usable files (header and size checked; the payload's CRC-32 is checked when ``load``
        reads it, so each byte is read once); removes leftovers of interrupted writes and moves damaged files aside
        (logged) so no plan counts on them."""
        ids = []
        self.other_world_sizes = set()
        self._keys = {}
        for path in sorted(self.local_dir.iterdir()):
            if ".tmp-" in path.name and path.name.startswith("."):
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX) or parse_id(path.name[: -len(SUFFIX)]) is None:
                continue
            try:
                header = check_file(path)
            except (LocalCheckpointCorruptError, OSError, ValueError) as exc:
                log.warning("local checkpoint file is damaged, not used: %s", exc)
                path.rename(path.with_name(f".corrupt-{path.name}"))
                continue
            if header.get("world_size", self.world_size) != self.world_size:
                self.other_world_sizes.add(header["world_size"])
                continue
            ids.append(path.name[: -len(SUFFIX)])
            self._keys[ids[-1]] = fence.key_of(header.get("fence"))
        return ids

    def _restore_sources(self) -> list[list[int]]:
        """For each rank, the ranks it can get its shard from (itself; with replication its whole clique)."""
        if self._sources is None:
            strategy = self._strategy()
            mine = list(strategy.group_ranks) if isinstance(strategy, CliqueReplicationStrategy) else [self.rank]
            self._sources = [list(g) for g in self._dist.all_gather_json(mine)]
        return self._sources

    def find_latest(self) -> int:
        """The newest iteration every rank can restore (from its files or replicas), agreed by all; -1 if none.
        Under ``nvrx launch`` this round's resume point joins the lineage (nvrx/ckpt/fence.py) in every rank dir."""
        self._finalize_pending()
        ids = self._scan()
        gathered = self._dist.all_gather_json([ids, sorted(self.other_world_sizes),
                                               [None if self._keys[i] is None else list(self._keys[i]) for i in ids],
                                               [list(e) for e in fence.read_lineage(self.local_dir)]])
        lineage = fence.merge_lineage([g[3] for g in gathered])
        available, left = fenced_out(gathered, lineage)
        iteration, skipped = newest_restorable(available, self._restore_sources())
        skipped = left + skipped
        fence.write_lineage(self.local_dir, fence.record_resume(lineage, iteration))
        others = sorted({w for _, ws, *_ in gathered for w in ws})
        if others:  # an elastic job that changed size: per-rank shards do not reshard (the global tier does)
            skipped.append(f"local checkpoints saved at world size {', '.join(map(str, others))} are not used at world "
                           f"size {self.world_size} (per-rank shards do not reshard; the global tier does)")
        if self.rank == 0:
            for reason in skipped:
                log.warning("local checkpoint %s; trying an older one", reason)
        self._found = (iteration, available, skipped)
        return iteration

    @property
    def find_notes(self) -> list[str]:
        """Why the last ``find_latest`` passed over newer local checkpoints (the same on every rank)."""
        return list(self._found[2]) if self._found is not None else []

    def load(self) -> tuple[TensorAwareStateDict, str]:
        """This rank's shard of the iteration ``find_latest`` found, and its id. Shards not held locally come from a
        replica holder. A copy found damaged while it is read is moved aside and every rank tries again (the other
        copy, or an older iteration). NoReplicasAvailableError if some shard has no copy left (restore from the
        global tier)."""
        for _ in range(_LOAD_ATTEMPTS):
            if self._found is None:
                self.find_latest()
            iteration, _, skipped = self._found
            if iteration < 0:  # the same on every rank (find_latest agreed)
                if skipped:
                    raise NoReplicasAvailableError(f"no local checkpoint can be restored ({skipped[0]}); "
                                                   "restore from the global checkpoint tier")
                raise LocalCheckpointError(f"no local checkpoint in {self.session_dir}")
            id_ = ckpt_id(iteration, self.rank)
            try:
                packed, error = self._fetch(), None
            except LocalCheckpointError as exc:
                packed, error = None, str(exc)
            errors = [e for e in self._dist.all_gather_json(error) if e]
            if not errors:
                break
            log.warning("local checkpoint %d: a copy failed while it was read (%s); trying the other copies",
                        self._found[0], errors[0])
            self._found = None
        else:
            raise LocalCheckpointError(f"local checkpoint could not be read in {_LOAD_ATTEMPTS} attempts: {errors[0]}")
        self.last_load_source = "own file" if id_ in self._found[1].get(self.rank, ()) else "replica"
        state = unpack(packed, verify=False)  # type: ignore[arg-type]
        if torch.cuda.is_available():
            state.restore_tensor_device()
        return state, id_

    def _fetch(self) -> Packed:
        """This rank's packed shard of the found iteration: its own file, else from a replica holder (collective)."""
        iteration, available, _ = self._found  # type: ignore[misc]
        strategy = self._strategy()
        if strategy is None:
            return self._read(ckpt_id(iteration, self.rank))
        wanted = [ckpt_id(iteration, r) for r in strategy.group_ranks]
        plan = strategy.retrieve_plan(available, wanted)
        return strategy.retrieve_execute(plan, self._read)

LOCAL_CKPT_DIR_ENV = "NVRX_LOCAL_CKPT_DIR"


def default_root() -> Path:
    """Where local checkpoints go when the script does not say: ``nvrx launch --local-ckpt-dir`` (NVRX_LOCAL_CKPT_DIR),
    else ``$SLURM_TMPDIR/nvrx-local-ckpt``, else ``/dev/shm/nvrx-local-ckpt-<uid>`` (node-local, memory speed)."""
    if os.environ.get(LOCAL_CKPT_DIR_ENV):
        return Path(os.environ[LOCAL_CKPT_DIR_ENV])
    if os.environ.get("SLURM_TMPDIR"):
        return Path(os.environ["SLURM_TMPDIR"]) / "nvrx-local-ckpt"
    return Path("/dev/shm") / f"nvrx-local-ckpt-{os.getuid()}"


def default_session() -> str:
    """The session when the script names none: the job's run id under a launcher (``TORCHELASTIC_RUN_ID``: the
    same in every attempt of the job, so a restart finds its checkpoints; ``nvrx launch`` removes that directory
    when the job succeeds), else ``default``."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id and "/" not in run_id and run_id not in (".", "..") else "default"
