"""Staging reserved after the first optimizer step (nvrx.ckpt.auto_reserve): a first save nobody announced finds its
buffer ready. Each case runs in a fresh process (the reservation is once per process); the observable is the
staging pool's buffers (ids, capacities, how many were created), never timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx import ckpt
from tests.ckpt.conftest import child_env

HERE = Path(__file__).resolve().parent


def _case(name: str, tmp_path: Path) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, str(HERE / "auto_reserve_cases.py"), name, str(tmp_path)], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_no_checkpointer_no_reservation(tmp_path: Path) -> None:
    out, _ = _case("no_checkpointer", tmp_path)
    assert out["status"]["armed"] is False
    assert out["hooks"] == 0 and out["buffers"] == 0


def test_opting_out_reserves_nothing_even_when_armed_before(tmp_path: Path) -> None:
    out, _ = _case("opt_out", tmp_path)
    assert out["status"]["done"] and out["status"]["counted"] == 0
    assert out["hooks"] == 0 and out["buffers"] == 0


def test_armed_before_torch_registers_when_torch_optim_is_imported_and_leaves_no_trace(tmp_path: Path) -> None:
    out, err = _case("import_watch", tmp_path)
    assert out["watching"]["watching_import"] and not out["watching"]["registered"]
    assert out["after_import"]["registered"] and out["hooks"] == 1
    assert not out["in_meta_path"]  # the import watch removed itself
    assert out["loader"] == out["spec_loader"] == "SourceFileLoader"  # torch's module keeps its own loader
    assert out["counted"] == out["expected"]  # parameters + Adam's moments and step, counted by hand
    assert out["created"] == 1
    assert "reserved" in err and "after the first step of Adam" in err  # the one INFO line


def test_first_save_uses_the_reserved_buffer_then_a_bigger_save_still_works(tmp_path: Path) -> None:
    out, err = _case("checkpointer", tmp_path)
    assert out["hooks_armed"] == 1
    assert out["after_a"]["counted"] == out["expected_a"]
    assert out["after_b"]["counted"] == out["expected_a"] + out["expected_b"]  # each optimizer once, summed
    assert out["after_b"]["reserved"] > out["after_b"]["counted"]  # plus the slack
    assert out["done"]  # a second step of a counted optimizer ends the counting
    assert out["reserved"]["capacity"] >= out["save_needs"]
    assert out["after_first_save"] == {"created": out["reserved"]["created"], "ids": out["reserved"]["ids"]}
    assert out["hooks_after_save"] == 0  # removed at the save, from the thread that steps
    assert out["after_bigger_save"]["created"] == out["reserved"]["created"] + 1  # today's path: a new buffer
    assert out["bigger_loaded_ok"]
    assert "more than the" in err  # the debug line saying why this save took a new buffer


def _wired() -> bool:
    from nvrx.nvrx_cli.launch_cmd import _OPTIONS

    return any("--async-ckpt" in names for names, _ in _OPTIONS)


@pytest.mark.skipif(not _wired(), reason="nvrx launch has no --async-ckpt flag")
@pytest.mark.parametrize("template", ["--fork-server", "--no-fork-server"])
def test_launch_async_ckpt_rank_reserves_after_the_first_step(launcher, tmp_path: Path, template: str) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    done = launcher.run("--standalone", "--nproc-per-node", "2", "--async-ckpt", template,
                        str(HERE / "auto_reserve_train.py"), str(root))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        info = json.loads((root / f"rank{rank}.json").read_text())
        before = info["before_torch"]
        assert before["armed"]
        if template == "--fork-server":  # torch.optim came with the fork: registered at once
            assert before["registered"] and not before["watching_import"]
        else:  # a spawned rank: registered when the script imported torch
            assert before["watching_import"] and not before["registered"]
        assert info["after_import"]["registered"]
        assert info["before_step"] == {"created": 0, "buffers": []}
        counted = info["after_first_step"]["counted"]
        # DTensor parameters sharded over 2 ranks: this rank's shards (param + 2 moments), not the full tensors
        assert 3 * info["local_param_bytes"] <= counted < 2 * info["full_param_bytes"]
        assert info["reserved_pool"]["created"] == 1
        (buf_id, capacity), = info["reserved_pool"]["buffers"]
        assert capacity >= info["save_needs"]
        assert info["after_save"] == {"created": 1, "buffers": [[buf_id, capacity]]}  # the save made no buffer
    assert done.stderr.count("checkpoint staging memory after the first step of Adam") >= 2
    ckpt.verify_checkpoint(root / "step_3")
    assert launcher.leftovers() == []
