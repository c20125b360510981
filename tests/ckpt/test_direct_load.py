"""The resume's direct reader (nvrx.ckpt.direct_load via nvrx.ckpt.load_latest): bytes straight into the target tensors,
CRC-32s checked while reading, damage found in any item makes the load fall back to an older checkpoint.
Real writer process, real files, one process (the 2-rank agreement runs in test_periodic's crash test)."""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path

import pytest
import torch

from nvrx import ckpt
from nvrx.ckpt import direct_load
from nvrx.ckpt.async_ckpt.file_writer import FileSlice, _is_data_member
from nvrx.ckpt.loader import list_checkpoints, load_metadata


def state(scale: float) -> dict:
    return {"model": {"w": torch.arange(600, dtype=torch.float32).reshape(20, 30) * scale,
                      "b": torch.arange(7, dtype=torch.int64) + int(scale),
                      "half": torch.ones(5, dtype=torch.bfloat16) * scale},
            "optim": {"lr": 0.25 * scale, "betas": [0.9, 0.99], "name": f"adam{scale}", "flag": True},
            "step": int(scale), "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5 * scale)}


def blank() -> dict:
    return {"model": {"w": torch.zeros(20, 30), "b": torch.zeros(7, dtype=torch.int64),
                      "half": torch.zeros(5, dtype=torch.bfloat16)},
            "optim": {"lr": 0.0, "betas": [0.0, 0.0], "name": "", "flag": False},
            "step": 0, "empty": torch.ones(0, 3), "scalar": torch.tensor(0.0)}


def assert_state(loaded: dict, scale: float) -> None:
    want = state(scale)
    for key in ("w", "b", "half"):
        assert torch.equal(loaded["model"][key], want["model"][key]), key
    assert loaded["optim"] == want["optim"] and loaded["step"] == want["step"]
    assert loaded["empty"].shape == (0, 3) and torch.equal(loaded["scalar"], want["scalar"])


def save_two(root: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    for n in (1, 2):
        cp.async_save(state(float(n)), root / f"step_{n}")
        cp.wait()


def flip_tensor(path: Path, fqn: str, at: int) -> None:
    """Flip a bit of byte AT of tensor FQN's raw data in checkpoint PATH."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = load_metadata(path)
    info = md.storage_data[MetadataIndex(fqn, [0] * len(md.state_dict_metadata[fqn].size))]
    flip(path / info.relative_path, data_member_offset(path, fqn) + at)


def data_member_offset(path: Path, fqn: str) -> int:
    """Where in its file the raw bytes of tensor FQN start (the zip data member of its blob)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = load_metadata(path)
    info = md.storage_data[MetadataIndex(fqn, [0] * len(md.state_dict_metadata[fqn].size))]
    with open(path / info.relative_path, "rb") as f, \
            zipfile.ZipFile(FileSlice(f.fileno(), info.offset, info.length)) as zf:
        member = next(i for i in zf.infolist() if _is_data_member(i.filename))
        f.seek(info.offset + member.header_offset)
        header = f.read(30)
    return info.offset + member.header_offset + 30 + int.from_bytes(header[26:28], "little") \
        + int.from_bytes(header[28:30], "little")


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_direct_read_round_trips_every_kind_of_value(tmp_path: Path) -> None:
    save_two(tmp_path)
    newest = list_checkpoints(tmp_path)[0]
    target = blank()
    status, why = direct_load.load_direct(newest.path, newest.manifest, load_metadata(newest.path), target, True)
    assert (status, why) == (direct_load.LOADED, "")
    assert_state(target, 2.0)
    assert ckpt.load_latest(tmp_path, again := blank()).path.name == "step_2"
    assert_state(again, 2.0)


@pytest.mark.parametrize("fqn", ["model.w", "model.half"])
def test_one_flipped_bit_in_a_tensor_falls_back_to_the_older_checkpoint(tmp_path: Path, fqn: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    save_two(tmp_path)
    flip_tensor(tmp_path / "step_2", fqn, 3)
    assert ckpt.find_latest_checkpoint(tmp_path, verify="sizes").path.name == "step_2"  # sizes cannot tell
    with caplog.at_level(logging.WARNING, logger="nvrx.ckpt.loader"):
        info_loaded = ckpt.load_latest(tmp_path, target := blank())
    assert info_loaded.path.name == "step_1"
    assert_state(target, 1.0)  # every value of the older one, over what the damaged one had written
    assert "step_2 is damaged" in caplog.text and "checksum" in caplog.text


def test_a_damaged_non_tensor_value_and_a_damaged_blob_header_are_caught(tmp_path: Path) -> None:
    save_two(tmp_path)
    newest = tmp_path / "step_2"
    manifest = json.loads((newest / "nvrx_manifest.json").read_text())
    name, entry = next((n, e) for n, e in manifest["files"].items() if n.endswith(".distcp"))
    byte_item = next(i for i in entry["items"] if i["kind"] != "tensor")
    flip(newest / name, byte_item["offset"] + byte_item["length"] - 2)
    assert ckpt.load_latest(tmp_path, target := blank()).path.name == "step_1"
    assert_state(target, 1.0)

    save_two(tmp_path / "again")
    newest = tmp_path / "again" / "step_2"
    name, entry = next((n, e) for n, e in json.loads((newest / "nvrx_manifest.json").read_text())["files"].items()
                       if n.endswith(".distcp"))
    blob = next(i for i in entry["items"] if i["kind"] == "tensor")
    flip(newest / name, blob["offset"])  # the blob's first zip header
    assert ckpt.load_latest(tmp_path / "again", target := blank()).path.name == "step_1"
    assert_state(target, 1.0)


def test_only_damaged_checkpoints_after_a_partial_read_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(state(3.0), tmp_path / "step_3")
    cp.wait()
    flip_tensor(tmp_path / "step_3", "model.w", 100)
    with pytest.raises(ckpt.CheckpointError, match="damaged after part of it was loaded"):
        ckpt.load_latest(tmp_path, blank())


def test_a_state_the_direct_reader_cannot_take_goes_through_dcp_and_is_still_verified(tmp_path: Path) -> None:
    save_two(tmp_path)
    target = blank()
    target["model"]["w"] = torch.zeros(30, 20).t()  # not contiguous: DCP's loader copies into it
    newest = list_checkpoints(tmp_path)[0]
    status, _ = direct_load.load_direct(newest.path, newest.manifest, load_metadata(newest.path), blank() | {
        "model": target["model"]}, True)
    assert status == direct_load.INELIGIBLE
    assert ckpt.load_latest(tmp_path, target).path.name == "step_2"
    assert_state(target, 2.0)

    flip_tensor(newest.path, "model.b", 1)
    target = blank()
    target["model"]["w"] = torch.zeros(30, 20).t()
    assert ckpt.load_latest(tmp_path, target).path.name == "step_1"  # the full verification pass caught it
    assert_state(target, 1.0)
