"""Bad input to `nvrx launch`: one clear line, exit 2, no traceback, nothing left running."""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import one_line_error, run_events, write_script


@pytest.fixture
def script(tmp_path):
    return write_script(tmp_path / "ok.py", "print('hello')\n")


@pytest.mark.parametrize("args,needles", [
    ([], ["missing the training script"]),
    (["--nproc-per-node", "two"], ["--nproc-per-node", "'two'"]),
    (["--nproc-per-node", "0"], ["--nproc-per-node", "at least 1"]),
    (["--nnodes", "3:2"], ["MIN (3) is larger than MAX (2)"]),
    (["--nnodes", "2", "--rdzv-endpoint", "host:port:x"], ["--rdzv-endpoint"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:99999"], ["port", "1..65535"]),
    (["--nproc-per-nod", "2"], ["--nproc-per-node"]),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], ["--node-rank 2", "0..1"]),
])
def test_bad_flags(launcher, script, args, needles):
    res = launcher.run(*args, *([str(script)] if args or False else []), timeout=30)
    one_line_error(res, *needles)
    assert launcher.leftovers(wait=0.5) == []


def test_missing_script(launcher, tmp_path):
    res = launcher.run("--nproc-per-node", "2", str(tmp_path / "nope.py"), timeout=30)
    one_line_error(res, "nope.py", "does not exist")


def test_port_in_use_by_another_program(launcher, script):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = launcher.run("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x",
                           "--rdzv-conf", "join_timeout=3", str(script), timeout=60)
    one_line_error(res, str(port), "in use")
    assert launcher.leftovers() == []


def test_unreachable_endpoint_after_bounded_wait(launcher, script):
    t0 = time.monotonic()
    # 192.0.2.1 (TEST-NET-1) is not local: this agent is a client and nobody answers
    res = launcher.run("--nnodes", "2", "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-id", "x",
                       "--rdzv-conf", "join_timeout=2", str(script), timeout=60)
    one_line_error(res, "192.0.2.1:29400", "after")
    assert time.monotonic() - t0 < 30
    assert launcher.leftovers() == []


# ---------------------------------------------------------------- fault tolerance settings

_LONG_SECTION = "s" * 65
_TOO_MANY_SECTIONS = ",".join(f"s{i}:10" for i in range(33))


@pytest.mark.parametrize("args,needles", [
    # values out of range would crash the rank monitor at run time; they are refused up front
    (["--ft-param-workload-check-interval", "1e308"], ["workload_check_interval", "too large", "86400"]),
    (["--ft-param-workload-check-interval=0.001"], ["workload_check_interval", "at least 0.01"]),
    (["--ft-param-rank-heartbeat-timeout", "-1"], ["rank_heartbeat_timeout", "greater than 0"]),
    (["--ft-param-rank-heartbeat-timeout", "inf"], ["rank_heartbeat_timeout", "finite"]),
    (["--ft-param-initial-rank-heartbeat-timeout", "1e308"], ["initial_rank_heartbeat_timeout", "too large"]),
    (["--ft-param-safety-factor", "abc"], ["safety_factor", "'abc'", "not a number"]),
    (["--ft-param-safety-factor", "1e9"], ["safety_factor", "at most 1000"]),
    (["--ft-param-rank-termination-signal", "SIGTREM"], ["rank_termination_signal", "did you mean SIGTERM"]),
    # unknown keys
    (["--ft-param-rank-hearbeat-timeout", "5"], ["--ft-param-rank-heartbeat-timeout"]),
    (["--ft-safety-facter=2"], ["--ft-safety-factor"]),
    # section names and count: the monitor's own limits, checked before anything starts
    (["--ft-param-rank-section-timeouts", f"{_LONG_SECTION}:5"], ["rank_section_timeouts", "1-64 characters"]),
    (["--ft-param-rank-section-timeouts", '{"bad name": 5}'], ["rank_section_timeouts", "'bad name'"]),
    (["--ft-param-rank-section-timeouts", _TOO_MANY_SECTIONS], ["rank_section_timeouts", "33 sections", "at most 32"]),
    (["--ft-param-rank-section-timeouts", "step:-3"], ["rank_section_timeouts", "'step'", "greater than 0"]),
])
def test_bad_ft_params(launcher, script, args, needles):
    res = launcher.run(*args, "--standalone", str(script), timeout=30)
    one_line_error(res, *needles)
    assert launcher.leftovers(wait=0.5) == []


@pytest.mark.parametrize("text,needles", [
    ("fault_tolerance:\n  rank_heartbeat_timout: 5\n", ["unknown key 'rank_heartbeat_timout'",
                                                         "did you mean 'rank_heartbeat_timeout'"]),
    ("- 1\n- 2\n", ["not a mapping"]),
    ("fault_tolerance:\n  workload_check_interval: 1.0e+308\n", ["workload_check_interval", "too large"]),
    (f"fault_tolerance:\n  rank_section_timeouts: {{{_LONG_SECTION}: 5}}\n", ["rank_section_timeouts", "1-64"]),
    ("fault_tolerance:\n  rank_section_timeouts: {" + ", ".join(f"s{i}: 1" for i in range(40)) + "}\n",
     ["rank_section_timeouts", "40 sections"]),
])
def test_bad_ft_yaml(launcher, script, tmp_path, text, needles):
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(text)
    res = launcher.run("--fault-tol-cfg-path", str(cfg), "--standalone", str(script), timeout=30)
    one_line_error(res, "ft.yaml", *needles)


def test_bad_ft_env(launcher, script):
    res = launcher.run("--standalone", str(script), env={"NVRX_FT_WORKLOAD_CHECK_INTERVAL": "1e308"}, timeout=30)
    one_line_error(res, "NVRX_FT_WORKLOAD_CHECK_INTERVAL", "too large")


def test_ft_precedence_defaults_yaml_env_flag(launcher, script, tmp_path):
    """defaults < YAML (`fault_tolerance:` key) < environment < --ft-param flag, as the agent logs it."""
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n"
                   "  workload_check_interval: 1\n"        # YAML only
                   "  safety_factor: 2\n"                   # YAML, then env
                   "  rank_heartbeat_timeout: 100\n")       # YAML, then env, then flag
    env = {"NVRX_FT_SAFETY_FACTOR": "3", "NVRX_FT_RANK_HEARTBEAT_TIMEOUT": "200",
           "NVRX_FT_RANK_TERMINATION_SIGNAL": "SIGTERM"}  # env only
    res = launcher.run("--fault-tol-cfg-path", str(cfg), "--ft-param-rank-heartbeat-timeout", "300",
                       "--rdzv-id", "prec", "--standalone", str(script), env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    config = next(e["config"] for e in run_events(tmp_path / "nvrx_logs" / "prec", "agent-") if e["ev"] == "ft_config")
    assert config["workload_check_interval"] == 1.0
    assert config["safety_factor"] == 3.0
    assert config["rank_heartbeat_timeout"] == 300.0
    assert config["rank_termination_signal"] == "SIGTERM"
    assert config["initial_rank_heartbeat_timeout"] == 3600.0  # default
    assert launcher.leftovers() == []
