"""LaunchConfig parsing: each bad value is one clear ConfigError; good values parse as torchrun's do."""

from __future__ import annotations

import signal

import pytest

from nvrx.launcher.agent.config import (ConfigError, Std, build_launch_config, parse_endpoint, parse_nnodes, parse_nproc,
                             parse_rdzv_conf, parse_signals, parse_std_map)


def test_nnodes():
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:2", "a", "1:2:3", "", "-1"):
        with pytest.raises(ConfigError):
            parse_nnodes(bad)


def test_nproc():
    assert parse_nproc("8") == 8
    assert parse_nproc("cpu") >= 1
    for bad in ("0", "two", "-1", "1.5", "gpu"):
        with pytest.raises(ConfigError):
            parse_nproc(bad)


@pytest.mark.parametrize("text,expected", [
    ("node1", ("node1", 29400)), ("node1:123", ("node1", 123)), ("10.0.0.1:5", ("10.0.0.1", 5)),
    ("[::1]:29500", ("::1", 29500)), ("[fe80::1]", ("fe80::1", 29400)),
])
def test_endpoint_ok(text, expected):
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["", "host:", "host:port", "host:0", "host:70000", "a b:1", "[::1]:x"])
def test_endpoint_bad(text):
    with pytest.raises(ConfigError):
        parse_endpoint(text)


def test_rdzv_conf_reads_known_keys_and_rejects_bad_numbers():
    conf = parse_rdzv_conf("join_timeout=5,last_call_timeout=0.5,read_timeout=60,is_host=1")
    assert conf["join_timeout"] == 5 and conf["last_call_timeout"] == 0.5
    assert parse_rdzv_conf("timeout=7")["join_timeout"] == 7
    for bad in ("join_timeout", "join_timeout=x", "last_call_timeout=-1"):
        with pytest.raises(ConfigError):
            parse_rdzv_conf(bad)


def test_std_maps_and_signals():
    assert parse_std_map("3", 2, "-r") == {0: Std.ALL, 1: Std.ALL}
    assert parse_std_map("0:1,1:2", 2, "-r") == {0: Std.OUT, 1: Std.ERR}
    with pytest.raises(ConfigError):
        parse_std_map("4", 2, "-r")
    assert parse_signals("SIGTERM,int,10") == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    for bad in ("SIGFOO", "SIGKILL"):
        with pytest.raises(ConfigError):
            parse_signals(bad)


def _raw(tmp_path, **kw):
    script = tmp_path / "s.py"
    script.write_text("")
    base = {"training_script": str(script), "nproc_per_node": "2", "nnodes": "1"}
    base.update(kw)
    return base


def test_build_single_node_defaults_to_standalone(tmp_path):
    cfg = build_launch_config(_raw(tmp_path), {"HOME": "/x"})
    assert cfg.rdzv.standalone and cfg.rdzv.host == "127.0.0.1" and cfg.rdzv.port == 0
    assert cfg.workers.base_env["OMP_NUM_THREADS"] == "1"
    assert cfg.workers.nproc_per_node == 2 and cfg.max_restarts == 0


def test_build_keeps_user_omp_threads_and_term_timeout(tmp_path):
    cfg = build_launch_config(_raw(tmp_path, term_timeout="120"), {"OMP_NUM_THREADS": "4"})
    assert cfg.workers.base_env["OMP_NUM_THREADS"] == "4"
    assert cfg.workers.term_timeout == 120.0


@pytest.mark.parametrize("kw,needle", [
    ({"nnodes": "2"}, "--rdzv-endpoint"),
    ({"nnodes": "2", "rdzv_endpoint": "h:1", "node_rank": "2"}, "out of range"),
    ({"nnodes": "1:2", "rdzv_endpoint": "h:1", "node_rank": "0"}, "fixed --nnodes"),
    ({"max_restarts": "-1"}, "--max-restarts"),
    ({"term_timeout": "soon"}, "--term-timeout"),
    ({"rdzv_backend": "zookeeper"}, "--rdzv-backend"),
    ({"rdzv_id": "a b"}, "--rdzv-id"),
    ({"module": True, "no_python": True}, "together"),
])
def test_build_errors(tmp_path, kw, needle):
    with pytest.raises(ConfigError) as err:
        build_launch_config(_raw(tmp_path, **kw), {})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_state_dir_precedence_flag_env_resume_default(tmp_path, monkeypatch):
    """Learned timeouts follow an auto-resume chain: `nvrx resume` exports NVRX_RESUME_STATE_DIR only."""
    monkeypatch.chdir(tmp_path)
    resume = {"NVRX_RESUME_STATE_DIR": str(tmp_path / "resume")}
    both = dict(resume, NVRX_STATE_DIR=str(tmp_path / "explicit"))
    default = build_launch_config(_raw(tmp_path, rdzv_id="job"), {})
    assert default.state_dir == tmp_path / "nvrx_logs" / "job" / "ft_state"
    assert build_launch_config(_raw(tmp_path), resume).state_dir == tmp_path / "resume" / "ft_state"
    assert build_launch_config(_raw(tmp_path), both).state_dir == tmp_path / "explicit"
    flag = build_launch_config(_raw(tmp_path, state_dir=str(tmp_path / "flag")), both)
    assert flag.state_dir == tmp_path / "flag"
    # the same for every job of the chain, whatever its run id (a continuation job gets a new one)
    first = build_launch_config(_raw(tmp_path, rdzv_id="job1"), resume)
    second = build_launch_config(_raw(tmp_path, rdzv_id="job2"), resume)
    assert first.state_dir == second.state_dir
