"""torchrun's worker contract, unit level: the rank environment's rules and the error file reader.

The key-by-key comparison with a real torchrun is tests/integration/test_worker_env.py.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat

import pytest

from nvrx.launcher.agent.agent import build_rank_env
from nvrx.launcher.agent.config import build_launch_config
from nvrx.launcher.agent.error_file import (MAX_ERROR_FILE_BYTES, MAX_TRACEBACK_CHARS, ErrorFiles, read_error_file,
                                       report_lines)
from nvrx.launcher.agent.rdzv_records import NodeInfo, RoundResult
from nvrx.launcher.agent.store import master_addr_for_ranks


def _cfg(tmp_path, env=None, **raw):
    script = tmp_path / "s.py"
    script.write_text("")
    base = {"training_script": str(script), "nproc_per_node": "2", "nnodes": "1", "log_dir": str(tmp_path / "logs")}
    base.update(raw)
    return build_launch_config(base, env if env is not None else {"HOME": "/x"})


def _round(nodes=((2,),), group_rank=0, restart_count=0):
    infos = tuple(NodeInfo(f"n{i}", f"10.0.0.{i}", n[0]) for i, n in enumerate(nodes))
    return RoundResult(3, group_rank, infos, restart_count, "host0.example", 4242, True)


# ---------------------------------------------------------------- the environment


def test_second_node_ranks_get_torchrun_values(tmp_path):
    cfg = _cfg(tmp_path, max_restarts="5", rdzv_id="job7", signals_to_handle="SIGTERM,SIGUSR1")
    env = build_rank_env(cfg, _round(nodes=((2,), (2,)), group_rank=1, restart_count=2), 1, error_file="/e/1.json")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME")} == {
        "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "ROLE_RANK": "3", "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default"}
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("host0.example", "4242")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_MAX_RESTARTS"] == "5"
    assert env["TORCHELASTIC_RUN_ID"] == "job7" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_ERROR_FILE"] == "/e/1.json"
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # torchrun's default


def test_nccl_async_error_handling_is_passed_on_from_the_agent(tmp_path):
    cfg = _cfg(tmp_path, env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert build_rank_env(cfg, _round(), 0)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


@pytest.mark.parametrize("nproc, env, expected", [
    ("2", {}, "1"),                          # several ranks per node: torchrun sets 1
    ("1", {}, None),                         # one rank: torchrun leaves it unset
    ("2", {"OMP_NUM_THREADS": "4"}, "4"),    # the user's value wins
])
def test_omp_num_threads_follows_torchrun(tmp_path, nproc, env, expected):
    cfg = _cfg(tmp_path, env=env, nproc_per_node=nproc)
    assert build_rank_env(cfg, _round(nodes=((int(nproc),),)), 0).get("OMP_NUM_THREADS") == expected


@pytest.mark.parametrize("parent, expected", [(None, ["0", "1"]), ("4,6,7", ["4", "6"])])
def test_virtual_local_rank_gives_each_rank_its_own_gpu(tmp_path, parent, expected):
    cfg = _cfg(tmp_path, env={} if parent is None else {"CUDA_VISIBLE_DEVICES": parent}, virtual_local_rank=True)
    envs = [build_rank_env(cfg, _round(), lr) for lr in range(2)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"] and [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == expected


def test_virtual_local_rank_with_too_few_visible_gpus_is_one_clear_error(tmp_path):
    from nvrx.common.errors import ConfigError

    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=3 lists 1"):
        _cfg(tmp_path, env={"CUDA_VISIBLE_DEVICES": "3"}, virtual_local_rank=True)


def test_master_addr_is_the_host_name_only_where_it_reaches_the_store():
    assert master_addr_for_ranks("10.1.2.3", "node7.cluster") == "node7.cluster"  # --local-addr, like torchrun
    name = socket.getfqdn()
    from nvrx.common.net import resolve

    bound = (resolve(name) or ["127.0.0.1"])[0]
    assert master_addr_for_ranks(bound, None) == (name if resolve(name) else bound)
    assert master_addr_for_ranks("192.0.2.77", None) == "192.0.2.77"  # TEST-NET: the name cannot resolve there


# ---------------------------------------------------------------- error files


def _write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_torch_record_format_is_read(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path = tmp_path / "error.json"
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        try:
            raise KeyError("missing shard")
        except KeyError as exc:
            ErrorHandler().record_exception(exc)  # what @record writes
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    err = read_error_file(path)
    assert err.message == "KeyError: 'missing shard'" and err.exc_type == "KeyError"
    assert "raise KeyError" in err.traceback and err.timestamp > 0
    assert err.to_fields()["file"] == str(path)


def test_plain_string_message_form(tmp_path):
    err = read_error_file(_write(tmp_path / "e.json", {"message": "it broke", "timestamp": "1700000000"}))
    assert (err.message, err.traceback, err.timestamp, err.exc_type) == ("it broke", None, 1700000000, "")


def test_missing_file_is_silent(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert read_error_file(tmp_path / "none.json") is None and read_error_file("") is None
    assert caplog.records == []


@pytest.mark.parametrize("content, why", [
    ("{not json", "not JSON"),
    (b"\xff\xfe\x00garbage", "not JSON"),
    ([1, 2], "no 'message' field"),
    ({"message": {"message": 5}}, "neither a string"),
    ("x" * (MAX_ERROR_FILE_BYTES + 1), "larger than"),
], ids=["torn", "binary", "list", "typed", "huge"])
def test_unusable_file_gives_one_warning(tmp_path, caplog, content, why):
    path = tmp_path / "e.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        _write(path, content)
    with caplog.at_level(logging.WARNING, logger="nvrx.launcher.agent.error_file"):
        assert read_error_file(path) is None
    assert len(caplog.records) == 1 and why in caplog.text and str(path) in caplog.text


def test_wrongly_typed_parts_are_dropped_and_long_traceback_cut(tmp_path):
    data = {"message": {"message": "E: x", "errorCode": "not a number",
                        "extraInfo": {"py_callstack": "a\n" * MAX_TRACEBACK_CHARS, "timestamp": 10 ** 30}}}
    err = read_error_file(_write(tmp_path / "e.json", data))
    assert err.error_code is None and err.timestamp is None
    assert err.traceback.startswith("...\n") and len(err.traceback) == MAX_TRACEBACK_CHARS + 4


def test_error_files_dir_is_private_and_stale_files_go(tmp_path):
    files = ErrorFiles(tmp_path / "run", "node1")
    old_umask = os.umask(0o022)
    try:
        path = files.path_for(0, 1)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(files.root.stat().st_mode) == 0o700
    _write(tmp_path / path, {"message": "old"})
    assert files.path_for(0, 1) == path and not os.path.exists(path)  # a later round with the same count
    files.remove()
    assert not files.root.exists()  # nothing recorded: nothing kept
    _write(tmp_path / files.path_for(1, 0), {"message": "kept"})
    files.remove()
    assert files.root.exists()


def test_report_lines_follow_torchrun_fields():
    lines = report_lines({"rank": 3, "local_rank": 1, "pid": 99, "exitcode": 1, "signal": None,
                          "error": {"file": "/f/error.json", "message": "E: x", "timestamp": 1700000000,
                                    "traceback": "Traceback (most recent call last):\nE: x\n"}})
    assert [ln.split(":")[0].strip() for ln in lines[:5]] == ["time", "rank", "exitcode", "error_file", "traceback"]
    assert lines[1:4] == ["rank      : 3 (local_rank: 1)", "exitcode  : 1 (pid: 99)", "error_file: /f/error.json"]
    assert lines[5:] == ["  Traceback (most recent call last):", "  E: x"]
    killed = report_lines({"rank": 0, "local_rank": 0, "pid": 5, "signal": "SIGKILL", "error": {"message": "m"}})
    assert "exitcode  : -9 (SIGKILL) (pid: 5)" in killed and killed[-2:] == ["traceback :", "  m"]


def test_a_linked_error_file_is_not_read_through(tmp_path):
    """A link at the rank's error file path: not followed (its target's text never reaches the report)."""
    from nvrx.launcher.agent.error_file import read_error_file

    secret = tmp_path / "secret.json"
    secret.write_text('{"message": "Secret: do not show"}')
    (tmp_path / "error.json").symlink_to(secret)
    assert read_error_file(tmp_path / "error.json") is None
