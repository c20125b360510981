"""Asynchronous checkpointing in one process: round trip through plain DCP, snapshot semantics, plan cache,
publication (latest, keep_last), verification, and bad input. Real writer process, real files."""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

from nvrx import ckpt
from nvrx.ckpt.async_ckpt.core import AsyncCallsQueue
from nvrx.ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvrx.ckpt.async_ckpt.state_dict_saver import (CheckpointMetadataCache, async_request, save_state_dict_async_finalize,
                                               save_state_dict_async_plan)
from nvrx.ckpt.async_ckpt.writer_process import default_writer


def dcp_load(state: dict, path: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(state, checkpoint_id=str(path))
    return state


def nested_state(scale: float = 1.0) -> dict:
    return {"model": {"w": torch.arange(600, dtype=torch.float32).reshape(20, 30) * scale,
                      "b": torch.arange(7, dtype=torch.int64), "half": torch.ones(5, dtype=torch.bfloat16) * scale},
            "optim": {"lr": 0.25, "betas": [0.9, 0.99], "name": "adam", "flag": True},
            "step": 11, "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)}


def blank_state() -> dict:
    return {"model": {"w": torch.zeros(20, 30), "b": torch.zeros(7, dtype=torch.int64),
                      "half": torch.zeros(5, dtype=torch.bfloat16)},
            "optim": {"lr": 0.0, "betas": [0.0, 0.0], "name": "", "flag": False},
            "step": 0, "empty": torch.ones(0, 3), "scalar": torch.tensor(0.0)}


def visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_round_trip_of_nested_state_through_plain_dcp_load(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    saved = nested_state(scale=3.0)
    cp.async_save(saved, tmp_path / "step_11")
    assert cp.wait() == [0]
    loaded = dcp_load(blank_state(), tmp_path / "step_11")
    for key in ("w", "b", "half"):
        assert torch.equal(loaded["model"][key], saved["model"][key]), key
    assert loaded["optim"] == saved["optim"] and loaded["step"] == 11
    assert loaded["empty"].shape == (0, 3) and loaded["scalar"].item() == 2.5
    assert visible(tmp_path) == ["latest", "step_11"] and hidden(tmp_path) == []
    assert (tmp_path / "latest").read_text().strip() == "step_11"
    ckpt.verify_checkpoint(tmp_path / "step_11")
    manifest = ckpt.list_checkpoints(tmp_path)[0].manifest
    assert sorted(p.name for p in (tmp_path / "step_11").iterdir()) == sorted([*manifest["files"], "nvrx_manifest.json"])


def test_checkpoint_holds_the_values_of_the_save_call(tmp_path: Path) -> None:
    """A training step that changes every tensor in place right after the call must not leak in."""
    state = {f"layer{i}": torch.full((1 << 21,), float(i)) for i in range(4)}  # 32 MiB: writing takes a while
    state["step"] = 1
    before = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(state, tmp_path / "step_1")
    for key, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            tensor.add_(100.0)
    state["step"] = 2
    cp.wait()
    loaded = dcp_load({k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()},
                      tmp_path / "step_1")
    for key, tensor in before.items():
        assert torch.equal(loaded[key], tensor), f"{key} holds values changed after the save call"
    assert loaded["step"] == 1


def test_torch_save_style_path_snapshots_and_loads_with_torch_load(tmp_path: Path) -> None:
    obj = {"rng": torch.arange(1 << 20, dtype=torch.float32), "epoch": 3, "names": ["a", "b"]}
    cp = ckpt.AsyncCheckpointer()
    cp.async_torch_save(obj, tmp_path / "extra_state.pt", update_latest=True)
    obj["rng"].mul_(-1)
    obj["epoch"] = 4
    cp.wait()
    loaded = torch.load(tmp_path / "extra_state.pt")
    assert torch.equal(loaded["rng"], torch.arange(1 << 20, dtype=torch.float32))
    assert loaded["epoch"] == 3 and loaded["names"] == ["a", "b"]
    info = ckpt.find_latest_checkpoint(tmp_path)
    assert info is not None and info.kind == "torch_save" and info.path.name == "extra_state.pt"
    assert hidden(tmp_path) == []


def test_plan_cache_is_reused_for_identical_saves_and_dropped_when_the_structure_changes(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    state = nested_state()
    cp.async_save(state, tmp_path / "a")
    cp.wait()
    assert cp.cache.get_metadata_caching_status()["misses"] == 1
    state["model"]["w"].fill_(7.0)
    state["step"] = 12
    cp.async_save(state, tmp_path / "b")
    cp.wait()
    status = cp.cache.get_metadata_caching_status()
    assert (status["hits"], status["misses"], status["validated_cache_reuse"]) == (1, 1, True)
    loaded = dcp_load(blank_state(), tmp_path / "b")
    assert torch.all(loaded["model"]["w"] == 7.0) and loaded["step"] == 12  # reuse keeps values current

    state["model"]["new"] = torch.ones(4)  # structure change: plan again
    del state["empty"]
    cp.async_save(state, tmp_path / "c")
    cp.wait()
    status = cp.cache.get_metadata_caching_status()
    assert (status["hits"], status["misses"], status["validated_cache_reuse"]) == (1, 2, False)
    target = blank_state()
    target["model"]["new"] = torch.zeros(4)
    del target["empty"]
    assert torch.equal(dcp_load(target, tmp_path / "c")["model"]["new"], torch.ones(4))
    assert "empty" not in ckpt.load_metadata(tmp_path / "c").state_dict_metadata  # the removed key is gone
    assert "empty" in ckpt.load_metadata(tmp_path / "b").state_dict_metadata


def test_cached_plan_writes_byte_identical_files_and_skips_global_planning(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    global_plans = []
    real = DefaultSavePlanner.create_global_plan
    monkeypatch.setattr(DefaultSavePlanner, "create_global_plan",
                        lambda self, plans: global_plans.append(len(plans)) or real(self, plans))
    state = nested_state(scale=5.0)
    cached = ckpt.AsyncCheckpointer(files_per_rank=3)
    for name in ("miss", "hit"):
        cached.async_save(state, tmp_path / name)
        cached.wait()
    assert global_plans == [1]  # the second save did no planning at all
    fresh = ckpt.AsyncCheckpointer(files_per_rank=3, enable_cache=False)
    fresh.async_save(state, tmp_path / "uncached")
    fresh.wait()
    assert global_plans == [1, 1]

    data = sorted(p.name for p in (tmp_path / "miss").glob("*.distcp"))
    assert len(data) == 3
    for other in ("hit", "uncached"):
        assert sorted(p.name for p in (tmp_path / other).glob("*.distcp")) == data
        for name in data:  # same plan -> the same items at the same offsets of the same files, byte for byte
            assert (tmp_path / other / name).read_bytes() == (tmp_path / "miss" / name).read_bytes(), (other, name)
        md, ref = ckpt.load_metadata(tmp_path / other), ckpt.load_metadata(tmp_path / "miss")
        assert md.state_dict_metadata == ref.state_dict_metadata and md.storage_data == ref.storage_data
    loaded = dcp_load(blank_state(), tmp_path / "hit")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["optim"] == state["optim"]


def test_spec_three_stage_api(tmp_path: Path) -> None:
    """plan -> AsyncCallsQueue (writer process) -> finalize, with the spec's names."""
    queue = AsyncCallsQueue()
    cache = CheckpointMetadataCache()
    state = {"x": torch.arange(10.0), "note": "hi"}
    for n in range(2):
        writer = FileSystemWriterAsync(tmp_path / f"s{n}", files_per_rank=1)
        writer_out, metadata, dist_wrapper = save_state_dict_async_plan(state, writer, enable_cache=True,
                                                                        metadata_cache=cache)
        assert writer_out is writer and metadata is not None and dist_wrapper.world_size == 1
        queue.schedule_async_request(async_request(writer_out, metadata, dist_wrapper))
        assert queue.get_num_unfinalized_calls() == 1
        assert queue.maybe_finalize_async_calls(blocking=True) == [n]
    assert cache.get_metadata_caching_status()["hits"] == 1
    assert dcp_load({"x": torch.zeros(10), "note": ""}, tmp_path / "s1")["note"] == "hi"
    with pytest.raises(ckpt.CheckpointError, match="write stage has not completed"):
        save_state_dict_async_finalize(writer, metadata, dist_wrapper)  # finalize without a completed write


def test_staging_that_fails_midway_stops_the_already_started_write(tmp_path: Path) -> None:
    """With early submission the writer starts before the copy ends; a failed copy must stop it cleanly."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class FailingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            if write_item.index.fqn == "late":
                raise RuntimeError("device lost")
            return super().resolve_data(write_item)

    writer_process = default_writer()
    state = {"early": torch.ones(1 << 22), "late": torch.ones(1 << 22)}
    writer = FileSystemWriterAsync(tmp_path / "bad", files_per_rank=1, writer_process=writer_process)
    with pytest.raises(RuntimeError, match="device lost"):
        save_state_dict_async_plan(state, writer, planner=FailingPlanner())
    cp = ckpt.AsyncCheckpointer()  # the same writer process goes on with the next save
    cp.async_save(state, tmp_path / "good")
    assert cp.wait() == [0]
    ckpt.verify_checkpoint(tmp_path / "good")
    assert not (tmp_path / "bad").exists() and writer_process.running()
    assert hidden(tmp_path) == []  # the abandoned save's partial directory is gone too


def writer_children() -> list[psutil.Process]:
    """This process's live checkpoint writer processes, as the OS sees them."""
    return [c for c in psutil.Process().children() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE
            and "nvrx.ckpt.async_ckpt.writer_main" in " ".join(c.cmdline())]


def test_writer_process_is_started_once_and_reused(tmp_path: Path) -> None:
    writer = default_writer()
    before = writer_children()
    assert [c.pid for c in before] == [writer.pid]  # one writer, and it is a real child process
    born = before[0].create_time()
    cp = ckpt.AsyncCheckpointer()
    torch_cp = ckpt.AsyncCheckpointer()
    for n in range(3):
        cp.async_save({"x": torch.full((100,), float(n))}, tmp_path / f"s{n}")
        torch_cp.async_torch_save({"n": n}, tmp_path / f"t{n}.pt")
        cp.wait()
        torch_cp.wait()
        after = writer_children()
        # the same OS process (pid and start time: not a new one that reused the pid) did every save
        assert [(c.pid, c.create_time()) for c in after] == [(writer.pid, born)], n
    assert writer.running() and torch.load(tmp_path / "t2.pt") == {"n": 2}
    assert dcp_load({"x": torch.zeros(100)}, tmp_path / "s2")["x"][0] == 2.0


def test_latest_pointer_and_keep_last(tmp_path: Path) -> None:
    (tmp_path / ".step_old.1a2b3c4d.deleting").mkdir()  # a deletion a crash interrupted: finished by the next save
    (tmp_path / ".step_old.1a2b3c4d.deleting" / "__0_0.distcp").write_bytes(b"x")
    cp = ckpt.AsyncCheckpointer(keep_last=2)
    for n in range(4):
        cp.async_save({"x": torch.full((10,), float(n))}, tmp_path / f"step_{n}")
        cp.wait()
    assert visible(tmp_path) == ["latest", "step_2", "step_3"] and hidden(tmp_path) == []
    assert (tmp_path / "latest").read_text().strip() == "step_3"
    assert [c.path.name for c in ckpt.list_checkpoints(tmp_path)] == ["step_3", "step_2"]


def test_published_checkpoint_whose_latest_update_failed_is_reported_as_published(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cp = ckpt.AsyncCheckpointer()
    cp.async_save({"x": torch.full((10,), 1.0)}, tmp_path / "step_1")
    cp.wait()
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # `latest` cannot be replaced any more
    (tmp_path / "latest" / "keep").write_text("x")
    cp.async_save({"x": torch.full((10,), 2.0)}, tmp_path / "step_2")
    with pytest.raises(ckpt.CheckpointCleanupError) as err:
        cp.wait()
    message = str(err.value)
    assert message.startswith(f"checkpoint {tmp_path / 'step_2'} was published and is complete, but updating the "
                              "`latest` pointer failed: Is a directory"), message
    assert "not published" not in message and "\n" not in message
    assert isinstance(err.value, ckpt.CheckpointWriteError) and cp.pending == 0
    ckpt.verify_checkpoint(tmp_path / "step_2")  # kept, not discarded
    assert ckpt.find_latest_checkpoint(tmp_path).path.name == "step_2"
    assert dcp_load({"x": torch.zeros(10)}, tmp_path / "step_2")["x"][0] == 2.0

    skipping = ckpt.AsyncCheckpointer(skip_failed=True)
    skipping.async_save({"x": torch.full((10,), 3.0)}, tmp_path / "step_3")
    assert skipping.wait() == [0]  # counted as published; a warning says what failed
    assert "step_3 was published and is complete, but updating the `latest` pointer failed" in caplog.text
    ckpt.verify_checkpoint(tmp_path / "step_3")
    with pytest.raises(ckpt.CheckpointCleanupError, match="extra.pt was published and is complete"):
        cp.async_torch_save({"a": 1}, tmp_path / "extra.pt", update_latest=True)
        cp.wait()
    assert torch.load(tmp_path / "extra.pt") == {"a": 1}


def test_loader_skips_a_damaged_newest_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cp = ckpt.AsyncCheckpointer()
    for n in range(2):
        cp.async_save({"x": torch.full((4096,), float(n)), "y": torch.ones(3)}, tmp_path / f"step_{n}")
        cp.wait()
    data = next(p for p in (tmp_path / "step_1").glob("*.distcp") if p.stat().st_size > 16000)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the tensor data
    data.write_bytes(bytes(raw))
    assert ckpt.find_latest_checkpoint(tmp_path, verify="sizes").path.name == "step_1"  # sizes alone cannot tell
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.verify_checkpoint(tmp_path / "step_1")
    info = ckpt.load_latest(tmp_path, target := {"x": torch.zeros(4096), "y": torch.zeros(3)})
    assert info.path.name == "step_0" and torch.all(target["x"] == 0.0)
    assert "step_1" in caplog.text

    with open(data, "r+b") as f:  # a truncated file fails the size check
        f.truncate(100)
    with pytest.raises(ckpt.CheckpointError, match="recorded"):
        ckpt.verify_checkpoint(tmp_path / "step_1", full=False)


# ---------------------------------------------------------------- bad input


def test_unserialisable_value_fails_at_the_call_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    cp.async_save({"x": torch.ones(3)}, tmp_path / "step_0")
    cp.wait()
    with pytest.raises(ckpt.CheckpointError, match=r"cannot save 'lock'.*cannot be serialised"):
        cp.async_save({"x": torch.ones(3), "lock": threading.Lock()}, tmp_path / "step_1")
    assert cp.pending == 0 and visible(tmp_path) == ["latest", "step_0"] and hidden(tmp_path) == []
    with pytest.raises(ckpt.CheckpointError, match="cannot be serialised"):
        cp.async_torch_save({"f": lambda: 1}, tmp_path / "obj.pt")
    assert cp.pending == 0 and not (tmp_path / "obj.pt").exists()
    ckpt.verify_checkpoint(tmp_path / "step_0")


def test_path_under_a_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "not_a_dir").write_text("x")
    cp = ckpt.AsyncCheckpointer()
    with pytest.raises(ckpt.CheckpointError, match="is a file, not a directory"):
        cp.async_save({"x": torch.ones(1)}, tmp_path / "not_a_dir" / "ckpts" / "step_1")
    with pytest.raises(ckpt.CheckpointError, match="is a file, not a directory"):
        cp.async_torch_save({"x": 1}, tmp_path / "not_a_dir" / "x.pt")
    assert cp.pending == 0


def test_reserved_names_are_refused(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    for name in ("latest", ".hidden"):
        with pytest.raises(ckpt.CheckpointError, match="is reserved"):
            cp.async_save({"x": torch.ones(1)}, tmp_path / name)
    assert cp.pending == 0 and list(tmp_path.iterdir()) == []


def test_maybe_finalize_without_a_pending_save_is_a_no_op(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    assert cp.maybe_finalize() == [] and cp.wait() == []
    assert AsyncCallsQueue().maybe_finalize_async_calls(blocking=True) == []
    cp.async_save({"x": torch.ones(2)}, tmp_path / "a")
    cp.wait()
    assert cp.wait() == []  # already finalized: nothing left


def test_second_save_to_a_pending_path_is_refused(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    cp.async_save({"x": torch.ones(1 << 20)}, tmp_path / "a")
    with pytest.raises(ckpt.CheckpointWriteError, match="still pending"):
        cp.async_save({"x": torch.ones(1 << 20)}, tmp_path / "a")
    assert cp.wait() == [0] and cp.pending == 0
    ckpt.verify_checkpoint(tmp_path / "a")


def test_invalid_arguments_are_named() -> None:
    with pytest.raises(ckpt.CheckpointError, match="keep_last=0"):
        FileSystemWriterAsync("/tmp/x", keep_last=0)
    with pytest.raises(ckpt.CheckpointError, match="state_dict must be a dict"):
        save_state_dict_async_plan([1, 2], FileSystemWriterAsync("/tmp/x"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="verify must be"):
        ckpt.find_latest_checkpoint("/tmp", verify="quick")


def test_a_writer_being_killed_is_stopped_not_failed_for_a_detach_or_save_meanwhile(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kill() closes the channel, then waits for the process; a staging finalizer's detach or another thread's
    save in that window must not write to the closed socket ("checkpoint writer failed: ... Bad file
    descriptor", seen once at a rank's sys.exit) nor start a second writer at interpreter exit."""
    from nvrx.ckpt.async_ckpt.writer_process import WriterProcess

    writer = WriterProcess()
    writer.start()
    proc = writer.proc
    seen: dict = {}
    real_wait = proc.wait

    def wait_and_poke(timeout=None):  # runs inside kill(), after the channel closed
        seen["running"] = writer.running()
        with pytest.raises(RuntimeError, match="was stopped"):
            writer.submit({"op": "noop"})
        return real_wait(timeout)

    proc.wait = wait_and_poke
    with caplog.at_level(logging.WARNING, logger="nvrx.ckpt.writer"):
        writer.kill()
    assert seen == {"running": False}
    assert not [r for r in caplog.records if "failed" in r.getMessage() or "starting a new" in r.getMessage()]
    assert writer.proc is None and proc.poll() is not None
