"""NVRx's asynchronous checkpoint API (spec 004), called the way Megatron-Core, NeMo and NVRx's examples call it.

Only the imports differ from NVRx code (``nvidia_resiliency_ext.checkpointing.async_ckpt.X`` -> ``nvrx.ckpt.async_ckpt.X``).
Real writer processes, real files, real forked children; the distributed sequence runs on 2 real gloo ranks.
"""

from __future__ import annotations

import inspect
import os
import warnings
import zipfile
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _is_wrapped_exception

from nvrx.ckpt.async_ckpt.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader
from nvrx.ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest, abort_nvrx_checkpoint
from nvrx.ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvrx.ckpt.async_ckpt.state_dict_saver import (CheckpointMetadataCache, save_state_dict_async_finalize,
                                               save_state_dict_async_plan)
from nvrx.ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from nvrx.ckpt.async_ckpt.writer_process import default_writer
from nvrx.ckpt.errors import CheckpointError
from tests.ckpt.conftest import run_two_ranks
from tests.conftest import tagged_processes

CKPT_TESTS = Path(__file__).resolve().parents[1] / "ckpt"


def dcp_load(state: dict, path: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(state, checkpoint_id=str(path))
    return state


def model_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A small real model and Adam optimizer after one step, and their state dict."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict()}


def plan(state: dict, path: Path, **writer_kw) -> tuple:
    """Megatron-Core's first steps: the writer, the plan (+ staging), the save function and its arguments."""
    writer = FileSystemWriterAsync(path, **writer_kw)
    save_state_dict_ret = save_state_dict_async_plan(state, writer, None, 0)
    return (writer, save_state_dict_ret, *writer.get_save_function_and_args())


def megatron_request(state: dict, path: Path, **writer_kw) -> tuple[AsyncRequest, FileSystemWriterAsync]:
    writer, ret, save_fn, preload_fn, save_args = plan(state, path, **writer_kw)
    return AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*ret)], preload_fn=preload_fn), writer


# ---------------------------------------------------------------- the distributed sequence, end to end


def test_megatron_core_sequence_on_two_gloo_ranks_saves_loads_and_fails_like_nvrx(tmp_path: Path) -> None:
    (r0, r1), token = run_two_ranks(CKPT_TESTS / "megatron_ranks.py", tmp_path, 150)
    for r in (r0, r1):
        assert r["call_idx"] == 0 and r["unfinalized_after_schedule"] == 1
        assert r["finalized"] == [0] and r["unfinalized_after_blocking"] == 0
        assert r["loaded_equals_saved"] is True  # dcp.load on both ranks returns what was saved
        assert r["live_differs_from_saved"] is True  # ... although training changed every tensor right after
        # a write that failed on rank 1 only: torch's CheckpointException on both ranks, naming rank 1
        failure = r["failure"]
        assert failure is not None and failure["ranks"] == [1] and failure["is_runtime_error"] is True
        assert "rank 1" in failure["message"] and "Is a directory" in failure["message"]
        assert r["unfinalized_after_failure"] == 0
    # the tracker (a finalize function added with add_finalize_fn) ran for the good save only
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_2", "latest"]  # the failed save left nothing behind

    # 2 -> 1: this process loads the checkpoint two ranks wrote, with the values of the save call
    expected = [torch.load(tmp_path / f"expected{r}.pt") for r in (0, 1)]
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    loaded = dcp_load({"model": model.state_dict(), "optimizer": opt.state_dict(), "embedding": torch.zeros(8, 3),
                       "iteration": 0}, tmp_path / "ckpt" / "iter_2")
    for key, value in expected[0]["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    for pid, moments in expected[0]["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(loaded["optimizer"]["state"][pid][name], value), (pid, name)
    assert torch.equal(loaded["embedding"], torch.cat([expected[0]["embedding"], expected[1]["embedding"]]))
    assert loaded["iteration"] == 2
    assert tagged_processes(token) == []  # ranks, writers and forked children are all gone


# ---------------------------------------------------------------- shapes and defaults


def test_async_request_field_order_defaults_and_methods() -> None:
    assert AsyncRequest._fields == ("async_fn", "async_fn_args", "finalize_fns", "async_fn_kwargs", "preload_fn",
                                    "is_frozen", "call_idx")
    calls: list[str] = []
    request = AsyncRequest(print, (1, 2), [lambda: calls.append("a")])  # positional, as Megatron-Core builds it
    assert (request.async_fn, request.async_fn_args, len(request.finalize_fns)) == (print, (1, 2), 1)
    assert (request.async_fn_kwargs, request.preload_fn, request.is_frozen, request.call_idx) == (None, None, False, 0)
    request.add_finalize_fn(lambda: calls.append("b"))
    frozen = request.freeze()
    assert frozen.is_frozen is True and request.is_frozen is False and frozen.finalize_fns == request.finalize_fns
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.add_finalize_fn(lambda: None)
    assert frozen._replace(call_idx=7).execute_finalize_fns() == 7
    assert calls == ["a", "b"]


def test_constructor_defaults_are_nvrx_s() -> None:
    queue_params = inspect.signature(AsyncCallsQueue).parameters
    assert {n: queue_params[n].default for n in ("persistent", "is_daemon", "cpu_priority", "io_priority",
                                                 "sigterm_timeout", "cpu_shm_mode")} == {
        "persistent": True, "is_daemon": True, "cpu_priority": 10, "io_priority": None, "sigterm_timeout": 30.0,
        "cpu_shm_mode": False}
    assert list(queue_params)[:6] == ["persistent", "is_daemon", "cpu_priority", "io_priority", "sigterm_timeout",
                                      "cpu_shm_mode"]
    finalize = inspect.signature(AsyncCallsQueue.maybe_finalize_async_calls).parameters
    assert (finalize["blocking"].default, finalize["no_dist"].default) == (False, False)
    assert inspect.signature(AsyncCallsQueue.close).parameters["abort"].default is False
    writer_params = inspect.signature(FileSystemWriterAsync).parameters
    assert {n: writer_params[n].default for n in ("separation_hint", "use_msc", "is_multiproc_io",
                                                  "use_cached_data_structure", "use_cpu_shm_for_gpu_tensors")} == {
        "separation_hint": None, "use_msc": False, "is_multiproc_io": False, "use_cached_data_structure": False,
        "use_cpu_shm_for_gpu_tensors": False}
    plan_params = inspect.signature(save_state_dict_async_plan).parameters
    assert list(plan_params) == ["state_dict", "storage_writer", "process_group", "coordinator_rank", "planner",
                                 "enable_cache", "metadata_cache"]
    assert inspect.signature(TorchAsyncCheckpoint).parameters["persistent_queue"].default is False
    torch_finalize = inspect.signature(TorchAsyncCheckpoint.finalize_async_save).parameters
    assert [(n, p.default) for n, p in torch_finalize.items() if n != "self"] == [
        ("blocking", False), ("no_dist", True), ("terminate", False)]


def test_file_system_writer_takes_torch_s_arguments(tmp_path: Path) -> None:
    assert FileSystemWriterAsync(tmp_path / "a", thread_count=3).files_per_rank == 3
    positional = FileSystemWriterAsync(tmp_path / "b", True, False, 4)  # single_file_per_rank, sync_files, thread_count
    assert (positional.sync_files, positional.files_per_rank) == (False, 4)
    assert FileSystemWriterAsync(tmp_path / "c", separation_hint="opt", is_multiproc_io=True).files_per_rank == 2
    with pytest.raises(NotImplementedError, match="single_file_per_rank"):
        FileSystemWriterAsync(tmp_path / "d", single_file_per_rank=False)
    with pytest.raises(CheckpointError, match="use_msc"):
        FileSystemWriterAsync(tmp_path / "e", use_msc=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'thread_cnt'"):
        FileSystemWriterAsync(tmp_path / "f", thread_cnt=2)
    (tmp_path / "exists").mkdir()
    with pytest.raises(CheckpointError, match="overwrite=False"):
        save_state_dict_async_plan({"x": torch.ones(2)}, FileSystemWriterAsync(tmp_path / "exists", overwrite=False))


# ---------------------------------------------------------------- one process


def test_save_function_and_args_write_and_retrieve_results(tmp_path: Path) -> None:
    _, _, state = model_state()
    writer, ret, save_fn, preload_fn, save_args = plan(state, tmp_path / "s", thread_count=2)
    assert ret[0] is writer and ret[1] is not None and ret[2].world_size == 1
    assert callable(save_fn) and callable(preload_fn) and save_args == [0, None]
    staged = preload_fn()  # what takes the None slot: this rank's write plan (files, items, offsets)
    assert [f["name"] for f in staged["files"]] == ["__0_0.distcp", "__0_1.distcp"]
    assert _is_wrapped_exception(writer.retrieve_write_results())  # nothing written yet: returned, not raised
    save_fn(save_args[0], staged)  # what the worker does with them: write now (on the writer process)
    results = writer.retrieve_write_results()
    assert results and all(isinstance(r, WriteResult) for r in results)
    assert {r.storage_data.relative_path for r in results} == {"__0_0.distcp", "__0_1.distcp"}
    save_state_dict_async_finalize(*ret)
    loaded = dcp_load(model_state(seed=9)[2], tmp_path / "s")
    assert torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_execute_sync_does_the_whole_request(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0)}
    request, _ = megatron_request(state, tmp_path / "sync")
    done: list[int] = []
    request.add_finalize_fn(lambda: done.append(1))
    request.execute_sync()
    assert done == [1] and torch.equal(dcp_load({"w": torch.zeros(6)}, tmp_path / "sync")["w"], state["w"])


def test_queue_schedules_in_order_and_returns_finalized_call_indices(tmp_path: Path) -> None:
    queue = AsyncCallsQueue()
    assert queue in AsyncCallsQueue.get_instances()
    state = {"w": torch.ones(10)}
    indices = []
    for n in range(2):
        request, _ = megatron_request(state, tmp_path / f"s{n}")
        indices.append(queue.schedule_async_request(request))
        state["w"].add_(1)  # the next step: the staged values are the ones saved
    assert indices == [0, 1] and queue.get_num_unfinalized_calls() == 2
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=False) == [0, 1]
    assert queue.maybe_finalize_async_calls(blocking=False) == []
    assert dcp_load({"w": torch.zeros(10)}, tmp_path / "s1")["w"][0] == 2.0
    queue.close()
    request, _ = megatron_request(state, tmp_path / "again")
    assert queue.schedule_async_request(request) == 0  # NVRx resets the call index on close
    queue.close()
    assert dcp_load({"w": torch.zeros(10)}, tmp_path / "again")["w"][0] == 3.0


def test_failed_write_raises_checkpoint_exception_and_skips_finalize(tmp_path: Path) -> None:
    queue = AsyncCallsQueue()
    request, _ = megatron_request({"w": torch.ones(4)}, tmp_path / "bad", thread_count=1)
    (tmp_path / ".bad.partial" / "__0_0.distcp").mkdir()  # the file rank 0 must write cannot be created
    ran: list[int] = []
    request.add_finalize_fn(lambda: ran.append(1))
    queue.schedule_async_request(request)
    with pytest.raises(CheckpointException) as caught:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    assert isinstance(caught.value, RuntimeError) and list(caught.value.failures) == [0]
    assert "Is a directory" in str(caught.value) and "previous checkpoint is intact" in str(caught.value)
    assert ran == [] and queue.get_num_unfinalized_calls() == 0
    assert sorted(os.listdir(tmp_path)) == []  # nothing published, the unfinished directory removed

    sync_request, _ = megatron_request({"w": torch.ones(4)}, tmp_path / "bad2", thread_count=1)
    (tmp_path / ".bad2.partial" / "__0_0.distcp").mkdir()
    with pytest.raises(CheckpointException, match="Is a directory"):  # execute_sync: finalize reports it
        sync_request.execute_sync()


def test_user_callable_runs_in_a_forked_child_with_the_arguments_of_the_call(tmp_path: Path) -> None:
    def dump(path: str, tensor: torch.Tensor) -> None:
        Path(path).write_text(f"{os.getpid()} {tensor.tolist()}")

    queue = AsyncCallsQueue()
    tensor = torch.tensor([1.0, 2.0])
    finalized: list[str] = []
    out = tmp_path / "out.txt"
    idx = queue.schedule_async_request(AsyncRequest(dump, (str(out), tensor), [lambda: finalized.append("done")]))
    tensor.add_(10)  # after the call: the child must not see it
    assert queue.maybe_finalize_async_calls(blocking=True) == [idx] and finalized == ["done"]
    pid, values = out.read_text().split(" ", 1)
    assert int(pid) != os.getpid() and values == "[1.0, 2.0]"

    noop = queue.schedule_async_request(AsyncRequest(None, (), [lambda: finalized.append("noop")]))
    assert queue.maybe_finalize_async_calls(blocking=True) == [noop] and finalized[-1] == "noop"

    def fail() -> None:
        raise ValueError("disk quota exceeded")

    queue.schedule_async_request(AsyncRequest(fail, (), [lambda: finalized.append("never")]))
    with pytest.raises(CheckpointException, match="ValueError: disk quota exceeded"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert finalized[-1] == "noop" and queue.get_num_unfinalized_calls() == 0


def test_persistent_false_queue_has_its_own_writer_with_nvrx_s_priorities(tmp_path: Path) -> None:
    queue = AsyncCallsQueue(persistent=False, cpu_priority=15, io_priority=3)
    assert queue.writer is not default_writer()
    request, _ = megatron_request({"w": torch.ones(3)}, tmp_path / "own")
    queue.schedule_async_request(request)
    writer = psutil.Process(queue.writer.pid)
    assert writer.nice() == 15 and writer.ionice().ioclass == psutil.IOPRIO_CLASS_IDLE
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    queue.close()
    assert not queue.writer.running() and not psutil.pid_exists(writer.pid)  # stopped and reaped
    assert default_writer().running()  # the process-wide writer is not the queue's to stop
    assert AsyncCallsQueue.warmup_persistent_caller(0) is default_writer()


def test_abort_nvrx_checkpoint_stops_and_drops_pending_calls(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()

    def wait_forever() -> None:
        os.read(read_end, 1)  # nothing is ever written: the child blocks until it is stopped

    queue = AsyncCallsQueue(sigterm_timeout=5.0)
    ran: list[int] = []
    queue.schedule_async_request(AsyncRequest(wait_forever, (), [lambda: ran.append(1)]))
    child = queue._local[0].work.pid  # type: ignore[union-attr]
    request, _ = megatron_request({"w": torch.ones(1 << 16)}, tmp_path / "aborted")
    queue.schedule_async_request(request)
    assert queue.get_num_unfinalized_calls() == 2
    abort_nvrx_checkpoint()
    os.close(write_end)
    os.close(read_end)
    assert queue.get_num_unfinalized_calls() == 0 and ran == []
    assert not psutil.pid_exists(child)  # stopped and reaped
    assert sorted(os.listdir(tmp_path)) == []  # the aborted save is not published and its files are gone
    assert default_writer().running()  # the writer itself goes on with later saves
    request, _ = megatron_request({"w": torch.ones(2)}, tmp_path / "after")
    queue.schedule_async_request(request)
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]


def test_torch_async_checkpoint(tmp_path: Path) -> None:
    ckpt = TorchAsyncCheckpoint()
    state = {"w": torch.arange(4.0), "step": 3}
    assert ckpt.async_save(state, tmp_path / "a.pt", pickle_protocol=4) is None
    state["w"].add_(100)
    assert ckpt.finalize_async_save(blocking=True) is None
    loaded = torch.load(tmp_path / "a.pt", weights_only=False)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["step"] == 3
    with zipfile.ZipFile(tmp_path / "a.pt") as archive:  # torch.save's own arguments were passed on
        pickled = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        assert archive.read(pickled)[:2] == b"\x80\x04"  # pickle protocol 4
    ckpt.async_save({"n": 1}, str(tmp_path / "b.pt"))
    ckpt.finalize_async_save(blocking=True, terminate=True)
    assert torch.load(tmp_path / "b.pt") == {"n": 1} and not ckpt._queue.writer.running()
    with pytest.raises(CheckpointError, match="writes to a path"):
        ckpt.async_save(state, open(os.devnull, "wb"))
    with pytest.raises(TypeError, match="needs the file"):
        ckpt.async_save(state)
    cached = CheckpointMetadataCache()  # spec 004's cache is importable and starts empty
    assert cached.get_cache_metadata() == (None, None, False, None)


def test_cached_metadata_reader_reads_once_and_never_serves_a_replaced_checkpoint(tmp_path: Path) -> None:
    CachedMetadataFileSystemReader.clear_metadata_cache()
    path = tmp_path / "ck"
    megatron_request({"w": torch.full((3,), 1.0)}, path)[0].execute_sync()
    first = CachedMetadataFileSystemReader(path).read_metadata()
    assert CachedMetadataFileSystemReader(path).read_metadata() is first  # another reader: from the cache
    assert CachedMetadataFileSystemReader(path, cache_metadata=False).read_metadata() is not first
    target = {"w": torch.zeros(3)}
    dcp.load(target, storage_reader=CachedMetadataFileSystemReader(path))
    assert torch.equal(target["w"], torch.full((3,), 1.0))

    megatron_request({"w": torch.full((3,), 2.0)}, path)[0].execute_sync()  # republished under the same name
    second = CachedMetadataFileSystemReader(path).read_metadata()
    assert second is not first and len(CachedMetadataFileSystemReader._metadata_cache) == 1
    dcp.load(target, storage_reader=CachedMetadataFileSystemReader(path))
    assert torch.equal(target["w"], torch.full((3,), 2.0))
    CachedMetadataFileSystemReader.clear_metadata_cache()
    assert CachedMetadataFileSystemReader._metadata_cache == {}
