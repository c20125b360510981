"""The three stages of an asynchronous DCP save: plan (+ staging), write (writer process), finalize.

``save_state_dict_async_plan`` runs in the training loop: planning (collective, or skipped when
the cached plans still hold) and the copy of the data into a staging buffer. Its result is handed
to the writer process as an ``AsyncRequest`` (see ``async_request``). ``save_state_dict_async_finalize``
runs once every rank's writes are durable: the coordinator writes the metadata and publishes.

Plans travel between ranks as JSON (``plan_codec``), never pickled. The ``CheckpointMetadataCache``
keeps the last local and central plans and the global metadata: when no rank's state-dict
structure changed, a save skips the plan exchange and the global planning (one small all-reduce
decides), and a resumed job can reuse the plans recorded in the checkpoint it loaded.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from nvrx.ckpt.async_ckpt import plan_codec
from nvrx.ckpt.async_ckpt.core import AsyncRequest
from nvrx.ckpt.async_ckpt.dist_wrapper import DistWrapper
from nvrx.ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync, describe_plans
from nvrx.ckpt.async_ckpt.write_errors import CheckpointWriteFailed
from nvrx.ckpt.errors import CheckpointCleanupError, CheckpointError, CheckpointWriteError

log = logging.getLogger("nvrx.ckpt.saver")

_PLANS_ATTR = "nvrx_plans"  # JSON of every rank's local and central plan, kept in the DCP metadata

# Seconds spent by the last save_state_dict_async_plan of this process in planning and in staging (the copy),
# and by the last finalize: the writer process's write (this rank) and the coordinator's publication.
last_plan_timings: dict[str, float] = {}
last_finalize_timings: dict[str, float] = {}


class CheckpointMetadataCache:
    """Plans and global metadata of the previous save, reused while the state-dict structure stays the same."""

    def __init__(self) -> None:
        self.cached_central_plan: SavePlan | None = None
        self.cached_local_plan: SavePlan | None = None
        self.cached_global_metadata: Metadata | None = None  # only on the coordinator
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.loaded_all_plans: list[SavePlan] | None = None
        self.loaded_central_plans: list[SavePlan] | None = None
        self.hits = 0
        self.misses = 0

    def get_cache_metadata(self) -> tuple[SavePlan | None, SavePlan | None, bool, list[SavePlan] | None]:
        """(cached central plan, cached local plan, whether reuse was validated, local plans loaded from a checkpoint)."""
        return self.cached_central_plan, self.cached_local_plan, self.validated_cache_reuse, self.loaded_all_plans

    def get_metadata_caching_status(self) -> dict[str, Any]:
        return {"validated_cache_reuse": self.validated_cache_reuse,
                "validated_loaded_metadata_reuse": self.validated_loaded_metadata_reuse,
                "has_cached_plans": self.cached_local_plan is not None,
                "hits": self.hits, "misses": self.misses}

    def prepare_save_state_dict_ret(self, rank: int, coordinator: int, save_state_dict_ret: tuple) -> tuple:
        """Put the cached global metadata into a plan result when this save reused the cache (coordinator only)."""
        writer, metadata, *rest = save_state_dict_ret
        reused = self.validated_cache_reuse or self.validated_loaded_metadata_reuse
        if rank == coordinator and metadata is None and reused:
            metadata = self.cached_global_metadata
        return (writer, metadata, *rest)

    def set_cache_metadata(self, central_plan: SavePlan, local_plan: SavePlan, global_md_verify_reuse: bool) -> None:
        """Remember this save's plans; GLOBAL_MD_VERIFY_REUSE says every rank's structure was unchanged."""
        self.validated_cache_reuse = bool(global_md_verify_reuse) and self.cached_central_plan == central_plan
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan

    def set_cached_global_metadata(self, cached_global_metadata: Metadata) -> None:
        """Adopt the metadata of a loaded checkpoint; its recorded plans let the next save skip planning."""
        self.cached_global_metadata = cached_global_metadata
        self.validated_loaded_metadata_reuse = False
        raw = getattr(cached_global_metadata, _PLANS_ATTR, None)
        if raw is None:
            log.debug("the loaded metadata records no plans: its reuse cannot be verified")
            self.loaded_all_plans = self.loaded_central_plans = None
            return
        plans = json.loads(raw)
        self.loaded_all_plans = [plan_codec.decode_plan(p) for p in plans["local"]]
        self.loaded_central_plans = [plan_codec.decode_plan(p) for p in plans["central"]]


_checkpoint_metadata_cache: CheckpointMetadataCache | None = None


def _global_cache() -> CheckpointMetadataCache:
    global _checkpoint_metadata_cache
    if _checkpoint_metadata_cache is None:
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    return _checkpoint_metadata_cache


def init_checkpoint_metadata_cache(cached_global_metadata: Metadata) -> CheckpointMetadataCache:
    """Start a fresh process-wide cache from the metadata of the checkpoint training resumed from."""
    global _checkpoint_metadata_cache
    _checkpoint_metadata_cache = CheckpointMetadataCache()
    _checkpoint_metadata_cache.set_cached_global_metadata(cached_global_metadata)
    return _checkpoint_metadata_cache


def get_metadata_caching_status() -> dict[str, Any] | None:
    """The process-wide cache's status (None before any cached save)."""
    return None if _checkpoint_metadata_cache is None else _checkpoint_metadata_cache.get_metadata_caching_status()


def verify_global_md_reuse(loaded_all_plans: list[SavePlan] | None, local_plan: SavePlan | None, rank: int,
                           dist_wrapper: DistWrapper) -> bool:
    """True iff on every rank the plan loaded from the checkpoint equals the plan of this save (collective)."""
    ok = (loaded_all_plans is not None and local_plan is not None and len(loaded_all_plans) == dist_wrapper.world_size
          and loaded_all_plans[rank] == local_plan)
    return dist_wrapper.all_true(ok)


# ---------------------------------------------------------------- planning


def _stateful_to_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Call state_dict() on Stateful values (as dcp.save does); tensors first: the protocol check is slow."""
    return {k: v if isinstance(v, torch.Tensor) or not isinstance(v, Stateful) else v.state_dict()
            for k, v in state_dict.items()}


def _describe_item(item: Any) -> str:
    if item.type == WriteItemType.BYTE_IO:
        return "a non-tensor value"
    td = item.tensor_data
    return f"{str(td.properties.dtype).removeprefix('torch.')} {list(td.size)}"


def check_consistent(all_plans: list[SavePlan]) -> None:
    """Refuse plans in which ranks disagree on what a key is (shape, dtype, tensor or not)."""
    seen: dict[str, tuple[str, int]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            what = _describe_item(item)
            first = seen.setdefault(item.index.fqn, (what, rank))
            if first[0] != what:
                raise CheckpointError(f"state dict structure differs between ranks: {item.index.fqn!r} is {first[0]} on "
                                      f"rank {first[1]} but {what} on rank {rank}; every rank must save the same keys "
                                      "with the same shapes and dtypes (use DTensor for per-rank shards)")


def _exchange_plans(dw: DistWrapper, planner: SavePlanner, writer: FileSystemWriterAsync, local_plan: SavePlan | None,
                    error: str | None) -> tuple[SavePlan, Metadata | None]:
    """Gather local plans (JSON) on the coordinator, plan globally there, hand each rank its central plan."""
    message: dict[str, Any] = {"plan": None, "error": error}
    if error is None and local_plan is not None:
        try:
            message["plan"] = plan_codec.encode_plan(local_plan)
        except CheckpointError as exc:
            message["error"] = str(exc)
    messages = dw.all_gather_json(message)
    errors = [f"rank {r}: {m['error']}" if dw.world_size > 1 else m["error"] for r, m in enumerate(messages) if m["error"]]
    if errors:
        _discard_after_failed_plan(dw, writer)
        raise CheckpointError("; ".join(errors) if dw.world_size == 1 else "checkpoint not saved: " + "; ".join(errors))
    global_md = None
    reply: dict[str, Any] = {}
    if dw.is_coordinator:
        try:
            all_local = [plan_codec.decode_plan(m["plan"]) for m in messages]
            check_consistent(all_local)
            all_central, global_md = planner.create_global_plan(all_local)
            all_central = writer.prepare_global_plan(all_central)
            setattr(global_md, _PLANS_ATTR, describe_plans(all_local, all_central))
            reply = {"plans": [plan_codec.encode_plan(p) for p in all_central]}
        except Exception as exc:
            reply = {"error": _reason(exc)}
    reply = dw.broadcast_json(reply)
    if "error" in reply:
        _discard_after_failed_plan(dw, writer)
        raise CheckpointError(reply["error"] if reply["error"].startswith("state dict") else f"checkpoint not saved: {reply['error']}")
    return plan_codec.decode_plan(reply["plans"][dw.rank]), global_md


def _reason(exc: Exception) -> str:
    """EXC as one line for an error reported on every rank (our own errors say it all; others get their type)."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _discard_after_failed_plan(dw: DistWrapper, writer: FileSystemWriterAsync) -> None:
    """Every rank is past creating the partial directory (it precedes the exchange): the coordinator removes it."""
    if dw.is_coordinator:
        writer.discard_partial()


def save_state_dict_async_plan(state_dict: dict[str, Any], storage_writer: FileSystemWriterAsync,
                               process_group: Any = None, coordinator_rank: int = 0, planner: SavePlanner | None = None,
                               enable_cache: bool = False, metadata_cache: CheckpointMetadataCache | None = None
                               ) -> tuple[FileSystemWriterAsync, Metadata | None, DistWrapper]:
    """Plan the save (collective) and stage this rank's data; returns (writer, global metadata or None, dist wrapper).

    When it returns, the values to save have been copied: training may change the tensors at once.
    Pass the result to ``async_request`` (or ``save_state_dict_async_finalize`` after writing).
    """
    if not isinstance(storage_writer, FileSystemWriterAsync):
        raise CheckpointError(f"storage_writer must be a FileSystemWriterAsync, not {type(storage_writer).__name__}")
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    started = time.perf_counter()
    dw = DistWrapper(process_group, coordinator_rank)
    storage_writer.dist_wrapper = dw
    planner = planner or DefaultSavePlanner()
    cache = (metadata_cache or _global_cache()) if enable_cache else None
    local_plan: SavePlan | None = None
    error: str | None = None
    try:
        storage_writer.set_up_storage_writer(dw.is_coordinator, rank=dw.rank)
        planner.set_up_planner(state_dict=_stateful_to_state_dict(state_dict),
                               storage_meta=storage_writer.storage_meta(), is_coordinator=dw.is_coordinator)
        local_plan = storage_writer.prepare_local_plan(planner.create_local_plan())
        storage_writer.serialize_objects(local_plan, planner)
    except Exception as exc:  # reported on every rank below, so no rank is left waiting in a collective
        error = _reason(exc)

    central_plan, global_md = _reuse_cached(cache, dw, local_plan, error)
    if central_plan is None:
        central_plan, global_md = _exchange_plans(dw, planner, storage_writer, local_plan, error)
        if cache is not None:
            assert local_plan is not None
            cache.misses += 1
            cache.set_cache_metadata(central_plan, local_plan, False)
            cache.validated_loaded_metadata_reuse = False
            if dw.is_coordinator:
                cache.cached_global_metadata = global_md
    planned = time.perf_counter()
    _stage_collectively(storage_writer, planner, central_plan, dw)
    last_plan_timings.update(plan=planned - started, stage=time.perf_counter() - planned)
    log.debug("checkpoint %s: planned in %.4f s, staged in %.4f s", storage_writer.path, last_plan_timings["plan"],
              last_plan_timings["stage"])
    return storage_writer, global_md, dw


def _stage_collectively(writer: FileSystemWriterAsync, planner: SavePlanner, central_plan: SavePlan,
                        dw: DistWrapper) -> None:
    """Copy this rank's data into staging, then agree with every rank that the copy worked (one all-reduce).

    A rank whose copy failed (no memory for the staging buffer, a tensor that changed shape, a device
    error) must not leave the other ranks to schedule a write whose finalize would wait for it forever:
    every rank abandons the save together, the unpublished directory is removed and the same error is
    raised everywhere. The previous checkpoint and ``latest`` are untouched.
    """
    error: str | None = None
    cause: Exception | None = None
    try:
        writer.prepare_write_data(planner.finish_plan(central_plan), planner)
    except Exception as exc:  # reported on every rank below; BaseException (Ctrl-C) ends the process anyway
        error, cause = _reason(exc), exc
    if dw.all_true(error is None):
        return
    writer.abandon_staging(error or "staging failed on another rank")
    errors = dw.all_gather_json(error)  # after it, no rank's writer still writes into the partial directory
    _discard_after_failed_plan(dw, writer)
    where = "; ".join(f"rank {r}: {e}" if dw.world_size > 1 else str(e) for r, e in enumerate(errors) if e)
    log.warning("checkpoint %s abandoned on every rank: staging failed (%s)", writer.path, where)
    raise CheckpointWriteError(f"checkpoint {writer.path} was not saved: copying the state into staging memory failed "
                               f"({where}); every rank abandoned this save and the previous checkpoint is intact") from cause


def _reuse_cached(cache: CheckpointMetadataCache | None, dw: DistWrapper, local_plan: SavePlan | None,
                  error: str | None) -> tuple[SavePlan | None, Metadata | None]:
    """The central plan (and, on the coordinator, metadata) from the cache if every rank's plan is unchanged."""
    if cache is None:
        return None, None
    plan = local_plan if error is None else None
    if cache.cached_local_plan is None:
        if cache.loaded_all_plans is None or cache.loaded_central_plans is None:
            return None, None
        if not verify_global_md_reuse(cache.loaded_all_plans, plan, dw.rank, dw):
            cache.loaded_all_plans = cache.loaded_central_plans = None  # checked once; plan normally from now on
            return None, None
        central = cache.loaded_central_plans[dw.rank]
        cache.validated_loaded_metadata_reuse = True
    else:
        if not dw.all_true(plan is not None and plan == cache.cached_local_plan):
            cache.validated_cache_reuse = False
            return None, None
        central = cache.cached_central_plan
    assert plan is not None and central is not None
    cache.hits += 1
    cache.set_cache_metadata(central, plan, True)
    return central, cache.cached_global_metadata if dw.is_coordinator else None


# ---------------------------------------------------------------- finalize


def save_state_dict_async_finalize(storage_writer: FileSystemWriterAsync, global_metadata: Metadata | None,
                                   dist_wrapper: DistWrapper) -> None:
    """Collect every rank's write results on the coordinator, which writes the metadata and publishes (collective)."""
    try:
        local: dict[str, Any] = {"ok": storage_writer.local_results()}
    except CheckpointError as exc:
        local = {"error": str(exc)}
    per_rank = dist_wrapper.all_gather_json(local)
    status: dict[str, Any] | None = None  # what went wrong, and whether the checkpoint is published anyway
    last_finalize_timings.clear()
    last_finalize_timings["write"] = storage_writer.write_seconds
    if dist_wrapper.is_coordinator:
        problems = [m["error"] for m in per_rank if "error" in m]
        try:
            if problems:
                status = {"published": False, "ranks": {str(r): m["error"] for r, m in enumerate(per_rank) if "error" in m}}
                raise CheckpointWriteError("; ".join(problems))
            if global_metadata is None:
                raise CheckpointWriteError("the coordinator has no global metadata for this save")
            started = time.perf_counter()
            storage_writer.finish_from_ranks(global_metadata, [m["ok"] for m in per_rank])
            last_finalize_timings["publish"] = time.perf_counter() - started
        except CheckpointCleanupError as exc:  # published; only `latest` / pruning failed: keep it
            status = {"published": True, "error": str(exc)}
        except Exception as exc:
            error = str(exc) if isinstance(exc, (CheckpointError, OSError)) else f"{type(exc).__name__}: {exc}"
            ranks = (status or {}).get("ranks") or {str(dist_wrapper.rank): error}
            status = {"published": False, "error": error, "ranks": ranks}
            storage_writer.discard_partial()
    status = dist_wrapper.broadcast_json(status)
    storage_writer.release_staging()
    if status and status["published"]:
        raise CheckpointCleanupError(status["error"])
    if status:
        raise CheckpointWriteFailed(f"checkpoint {storage_writer.path} was not published: {status['error']}; "
                                    "the previous checkpoint is intact",
                                    {int(r): e for r, e in status["ranks"].items()})


def async_request(storage_writer: FileSystemWriterAsync, global_metadata: Metadata | None,
                  dist_wrapper: DistWrapper) -> AsyncRequest:
    """The request that writes the staged data in the writer process and then finalizes this save.

    Built exactly as Megatron-Core builds its own from NVRx's pieces, so both paths are one.
    """
    storage_writer.dist_wrapper = dist_wrapper
    save_fn, preload_fn, save_args = storage_writer.get_save_function_and_args()
    return AsyncRequest(save_fn, save_args,
                        [functools.partial(save_state_dict_async_finalize, storage_writer, global_metadata, dist_wrapper)],
                        preload_fn=preload_fn)
