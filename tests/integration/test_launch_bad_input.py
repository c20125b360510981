"""Bad input to `nvrx launch`: one clear line, exit 2, no traceback, nothing left running."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest

from tests.conftest import one_line_error, run_events, wait_for, write_script


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


# ---------------------------------------------------------------- issue 27: values that ended in a traceback,
# a hang, or were accepted without a word


@pytest.mark.parametrize("args,needles", [
    # OverflowError tracebacks once a deadline was computed from them
    (["--rdzv-conf", "keepalive_interval=inf"], ["keepalive_interval", "finite"]),
    (["--term-timeout", "inf"], ["--term-timeout", "finite"]),
    (["--term-timeout", "1e308"], ["--term-timeout", "too large"]),
    # accepted without a word
    (["--rdzv-conf", "keepalive_interval=0"], ["keepalive_interval", "at least 0.05"]),
    (["--max-restarts", "1" + "0" * 30], ["--max-restarts", "at most 1000000"]),
    (["--signals-to-handle", ""], ["--signals-to-handle", "names no signal"]),
    (["--ft-param-log_level", "99"], ["log_level", "above CRITICAL"]),
    (["--local-ckpt-dir", "/"], ["--local-ckpt-dir", "root directory"]),
    (["--local-ckpt-dir", "/proc/nvrx-ckpt"], ["--local-ckpt-dir", "proc file system"]),
    # a count beyond what the machine can hold
    (["--nproc-per-node", "100000"], ["--nproc-per-node 100000", "this machine can hold at most"]),
    (["--nnodes", "100000000"], ["--nnodes", "at most 65536"]),
    # options that did nothing: say so
    (["--rdzv-backend", "etcd"], ["--rdzv-backend etcd", "no etcd rendezvous"]),
    (["--rdzv-backend", "etcd-v2"], ["--rdzv-backend etcd-v2", "no etcd rendezvous"]),
])
def test_refused_at_once(launcher, script, args, needles):
    res = launcher.run(*args, "--standalone", str(script), timeout=60)
    one_line_error(res, *needles)
    assert launcher.leftovers(wait=0.5) == []


@pytest.mark.parametrize("args,needles", [
    (["--master-addr", "bad host!"], ["--master-addr 'bad host!'", "not a host name"]),
    (["--master-addr", "no-such-host.invalid"], ["--master-addr", "no-such-host.invalid", "does not resolve"]),
    (["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400"], ["--rdzv-endpoint", "does not resolve"]),
    (["--local-addr", "no-such-host.invalid", "--standalone"], ["--local-addr", "does not resolve"]),
])
def test_bad_host_names_fail_before_the_first_round(launcher, script, args, needles):
    """A host name that cannot resolve kept the agent silent until the join timeout (600 s by default)."""
    t0 = time.monotonic()
    res = launcher.run(*args, str(script), timeout=90)
    one_line_error(res, *needles)
    assert time.monotonic() - t0 < 60
    assert launcher.leftovers(wait=0.5) == []


def test_empty_script_runs_and_says_so(launcher, tmp_path):
    empty = write_script(tmp_path / "empty.py", "")
    res = launcher.run("--standalone", "--nproc-per-node", "2", str(empty), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "empty.py is empty: each rank runs nothing" in res.stderr
    assert "Traceback" not in res.stderr


def test_inactive_nvrx_settings_are_named_once_on_stderr(launcher, script, tmp_path):
    """NVRx settings nvrx does not act on were only mentioned at INFO in each monitor's private log."""
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  max_no_progress_cycles: 7\n  enable_nic_monitor: true\n")
    res = launcher.run("--fault-tol-cfg-path", str(cfg), "--ft-param-num-warmup-iterations", "9",
                       "--nproc-per-node", "2", "--standalone", str(script), timeout=120)
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if "accepted but not acted on" in line]
    assert len(said) == 1, res.stderr  # once per agent, not per rank or monitor
    assert "enable_nic_monitor, max_no_progress_cycles, num_warmup_iterations" in said[0]
    res = launcher.run("--standalone", str(script), timeout=120)  # defaults only: nothing to say
    assert res.returncode == 0 and "not acted on" not in res.stderr, res.stderr


def test_sigterm_while_spawning_stops_within_5_s(launcher, tmp_path):
    """Many ranks take seconds to start (and as many monitors); a SIGTERM then waited for all of them, and a rank
    forked a moment before it could lose the signal and last until --term-timeout."""
    from nvrx.launcher.agent.config import machine_rank_capacity

    nproc = min(256, machine_rank_capacity()[0])
    sleeper = write_script(tmp_path / "sleep.py", "import time\ntime.sleep(300)\n")
    proc = launcher.start("--standalone", "--nproc-per-node", str(nproc), str(sleeper))
    seen: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            seen.append(line)

    threading.Thread(target=read_stderr, daemon=True).start()
    assert wait_for(lambda: any("round 0" in line for line in seen), 120), seen  # spawning starts now
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        waited = time.monotonic() - t0
    assert proc.returncode == 143, "".join(seen)
    assert waited < 5.0, f"{waited:.1f} s after SIGTERM\n" + "".join(seen)
    assert launcher.leftovers() == []
