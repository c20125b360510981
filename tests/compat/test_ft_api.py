"""NVRx fault-tolerance API, called the way NVRx's docs, examples and spec 001 call it.

Only the imports differ from NVRx code (``nvidia_resiliency_ext.fault_tolerance`` -> ``nvrx.monitors``).
The launch tests run real ranks (gloo on CPU) under ``nvrx launch``; the server test starts a monitor
with ``RankMonitorServer.run_in_subprocess`` the way NVRx's launcher does and attaches a real rank process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nvrx.monitors import (FaultToleranceConfig, HeartbeatTimeouts, RankMonitorClient, RankMonitorClientError,
                      RankMonitorServer, SectionTimeouts, WorkloadAction, WorkloadControlRequest)
from nvrx.common.errors import NvrxError
from tests.conftest import run_events, write_script

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- FaultToleranceConfig

NVRX_FIELDS = (  # NVRx's config fields (fault_tolerance/config.py); every one must be accepted
    "workload_check_interval", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_section_timeouts",
    "rank_out_of_section_timeout", "node_health_check_interval", "safety_factor", "rank_termination_signal",
    "log_level", "restart_check_interval", "enable_nic_monitor", "enable_nic_healthcheck",
    "enable_dist_storage_healthcheck", "storage_healthcheck_path", "pci_topo_file", "link_down_path_template",
    "link_state_path_template", "skip_section_response", "segment", "numa_bind_strict", "gpu_memory_reclaim_timeout",
    "gpu_memory_tolerance_mb", "gpu_memory_poll_interval", "check_remaining_processes", "max_no_progress_cycles",
    "min_progress_iterations", "checkpoint_iteration_file", "install_exception_hook", "num_warmup_iterations",
    "attribution_endpoint", "attribution_stop_action", "attribution_export_url", "cycle_info_dir",
    "segment_health_check_dir",
)


def _sample_config() -> FaultToleranceConfig:
    return FaultToleranceConfig.from_kwargs(
        workload_check_interval=2.0, initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=120.0,
        rank_section_timeouts={"setup": 600, "step": None}, rank_out_of_section_timeout=30.0,
        rank_termination_signal="sigterm", log_level="DEBUG", enable_nic_monitor=True, segment=4,
        max_no_progress_cycles=2, num_warmup_iterations=7, checkpoint_iteration_file="/tmp/iter.txt",
        gpu_memory_tolerance_mb=256.0)


def test_config_has_every_nvrx_field_and_the_spec_defaults() -> None:
    names = {f.name for f in dataclasses.fields(FaultToleranceConfig)}
    assert set(NVRX_FIELDS) <= names
    cfg = FaultToleranceConfig()
    # spec 001's defaults (the NVRx docs agree; newer NVRx code leaves the two timeouts None)
    assert (cfg.workload_check_interval, cfg.initial_rank_heartbeat_timeout, cfg.rank_heartbeat_timeout,
            cfg.safety_factor, cfg.rank_termination_signal, cfg.log_level) == (5.0, 3600.0, 2700.0, 5.0,
                                                                             signal.SIGKILL, logging.INFO)
    assert (cfg.skip_section_response, cfg.max_no_progress_cycles, cfg.num_warmup_iterations) == (True, 3, 5)
    assert cfg.is_progress_tracking_enabled


def test_config_yaml_round_trip(tmp_path: Path) -> None:
    cfg = _sample_config()
    assert cfg.rank_termination_signal == signal.SIGTERM and cfg.log_level == logging.DEBUG
    path = tmp_path / "ft.yaml"
    cfg.to_yaml_file(str(path))
    assert set(yaml.safe_load(path.read_text())) == {"fault_tolerance"}
    assert FaultToleranceConfig.from_yaml_file(str(path)) == cfg


def test_from_yaml_file_finds_the_section_at_any_depth_and_ignores_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "nemo.yaml"  # a NeMo-style experiment config: the section sits under exp_manager
    path.write_text("trainer: {devices: 2}\nexp_manager:\n  callbacks:\n    - name: x\n"
                    "      fault_tolerance:\n        rank_heartbeat_timeout: 45\n        some_future_key: 1\n")
    cfg = FaultToleranceConfig.from_yaml_file(str(path))
    assert cfg.rank_heartbeat_timeout == 45.0
    with pytest.raises(ValueError, match="Not recognized args.*some_future_key"):
        FaultToleranceConfig.from_yaml_file(str(path), ignore_not_recognized=False)
    (tmp_path / "none.yaml").write_text("trainer: {devices: 2}\n")
    with pytest.raises(ValueError, match="no 'fault_tolerance:'"):
        FaultToleranceConfig.from_yaml_file(str(tmp_path / "none.yaml"))


def test_from_kwargs_ignores_or_refuses_unknown_names() -> None:
    assert FaultToleranceConfig.from_kwargs(safety_factor=2.0, not_a_field=1).safety_factor == 2.0
    with pytest.raises(ValueError, match="Not recognized args.*'safety_factr'.*did you mean 'safety_factor'"):
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, safety_factr=2.0)


def _nvrx_style_parser() -> argparse.ArgumentParser:
    """The launcher's arguments as NVRx declares them: one --ft-<field> per field, dest ft_<field>, strings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ft-cfg-path", "--ft-cfg_path", dest="ft_cfg_path", default=None)
    for f in dataclasses.fields(FaultToleranceConfig):
        parser.add_argument(f"--ft-{f.name.replace('_', '-')}", f"--ft-{f.name}", dest=f"ft_{f.name}", default=None,
                            type=str)
    return parser


def test_from_args_layers_flags_over_the_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "ft.yaml"
    _sample_config().to_yaml_file(str(path))
    args = _nvrx_style_parser().parse_args([
        "--ft-cfg-path", str(path), "--ft-rank-heartbeat-timeout", "none", "--ft-rank_section_timeouts",
        "step:30,ckpt:600", "--ft-safety-factor", "3", "--ft-rank-termination-signal", "SIGKILL",
        "--ft-enable-nic-monitor", "false", "--ft-rank-out-of-section-timeout", ""])
    cfg = FaultToleranceConfig.from_args(args)
    assert cfg.rank_heartbeat_timeout is None and cfg.rank_out_of_section_timeout is None
    assert dict(cfg.rank_section_timeouts) == {"step": 30.0, "ckpt": 600.0}
    assert cfg.safety_factor == 3.0 and cfg.rank_termination_signal == signal.SIGKILL
    assert cfg.enable_nic_monitor is False
    assert cfg.segment == 4 and cfg.workload_check_interval == 2.0  # from the file, not overridden
    assert FaultToleranceConfig.from_args(_nvrx_style_parser().parse_args([])) == FaultToleranceConfig()


@pytest.mark.parametrize("kwargs, needle", [
    ({"safety_factor": -1}, "safety_factor"),
    ({"rank_termination_signal": "SIGFOO"}, "rank_termination_signal"),
    ({"log_level": "LOUD"}, "log_level"),
    ({"rank_section_timeouts": "step:soon"}, "step"),
    ({"segment": 0}, "segment"),
    ({"num_warmup_iterations": 1.5}, "num_warmup_iterations"),
    ({"enable_nic_monitor": "maybe"}, "enable_nic_monitor"),
])
def test_bad_values_are_refused_with_one_line(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        FaultToleranceConfig.from_kwargs(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError):
        FaultToleranceConfig.from_args(_nvrx_style_parser().parse_args(
            [f"--ft-{next(iter(kwargs)).replace('_', '-')}", str(next(iter(kwargs.values())))]))


# ---------------------------------------------------------------- value types and client errors


def test_value_types_match_nvrx() -> None:
    assert HeartbeatTimeouts() == HeartbeatTimeouts(None, None, None) and not HeartbeatTimeouts().are_valid
    assert HeartbeatTimeouts(10.0, 5.0).are_valid
    sec = SectionTimeouts(section={"step": 3.0}, out_of_section=2.0, calculated_sections=["step"],
                          is_out_of_section_calculated=True)
    assert sec.calculated_sections == {"step"} and sec.were_calculated and sec.are_valid
    assert not SectionTimeouts(section={"step": None}, out_of_section=1.0).are_valid
    assert [(a.name, a.value) for a in WorkloadAction] == [("Continue", 0), ("ExcludeThisNode", 1),
                                                          ("ShutdownWorkload", 2)]
    req = WorkloadControlRequest(WorkloadAction.ExcludeThisNode, "bad GPU")
    assert (req.action, req.description) == (WorkloadAction.ExcludeThisNode, "bad GPU")
    assert WorkloadControlRequest(WorkloadAction.Continue).description == "<not set>"
    assert issubclass(RankMonitorClientError, NvrxError)


def test_client_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NVRX_MONITOR_SOCKET", "NVRX_MONITOR_TOKEN", "NVRX_MONITOR_SHM", "FT_RANK_MONITOR_IPC_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    client = RankMonitorClient()
    assert not client.is_initialized and client.hb_timeouts is None and client.section_timeouts is None
    for call in (client.send_heartbeat, lambda: client.start_section("step"), lambda: client.end_section("step"),
                 client.end_all_sections, client.calculate_and_set_hb_timeouts, client.state_dict):
        with pytest.raises(RankMonitorClientError, match="not initialized"):
            call()
    client.shutdown_workload_monitoring()  # no error when never initialized, as in NVRx
    with pytest.raises(RankMonitorClientError, match="nvrx launch"):
        client.init_workload_monitoring()
    with pytest.raises(RankMonitorClientError, match="load_state_dict"):
        client.load_state_dict({"current_timeouts": {"heartbeat": {"initial": -5, "subsequent": 1,
                                                                   "were_calculated": True}}})


def test_nvrx_call_shapes_of_issue_27() -> None:
    """What NVRx code does that failed here: assign a setting, pass num_warmup_iters, import RankMonitorState."""
    from nvrx import fault_tolerance

    cfg = fault_tolerance.FaultToleranceConfig()
    cfg.rank_heartbeat_timeout = 10.0  # a FrozenInstanceError before
    cfg.rank_termination_signal = signal.SIGTERM
    assert (cfg.rank_heartbeat_timeout, cfg.rank_termination_signal) == (10.0, signal.SIGTERM)
    with pytest.raises(ValueError, match="rank_heartbeat_timeout"):
        cfg.rank_heartbeat_timeout = "soon"
    state = fault_tolerance.RankMonitorState
    assert [s.name for s in state] == ["UNINITIALIZED", "INITIALIZE", "HANDLING_START", "HANDLING_PROCESSING",
                                       "HANDLING_COMPLETED", "FINALIZED", "ABORTED"]
    client = fault_tolerance.RankMonitorClient()
    with pytest.raises(ValueError, match="num_warmup_iters"):
        client.init_workload_monitoring(num_warmup_iters=-1)


# ---------------------------------------------------------------- RankMonitorServer, as NVRx's launcher uses it

SERVER_RANK = r'''
import json, sys, time
from nvrx.monitors import RankMonitorClient
c = RankMonitorClient()
c.init_workload_monitoring(num_warmup_iters=5)  # NVRx code passes it (a TypeError here before issue 27)
print("CFG", json.dumps({"hb": c.cfg.rank_heartbeat_timeout, "sig": c.cfg.rank_termination_signal.name}), flush=True)
for _ in range(3):
    c.start_section("step"); c.end_section("step"); c.send_heartbeat()
if sys.argv[1:] == ["crash"]:
    c.start_section("step")
    raise ZeroDivisionError("boom in step")
print("READY", flush=True)
time.sleep(120)  # hangs: no more heartbeats
'''


def test_rank_monitor_server_watches_a_rank_started_with_nvrx_socket_variable(tmp_path: Path) -> None:
    cfg = FaultToleranceConfig(initial_rank_heartbeat_timeout=30.0, rank_heartbeat_timeout=1.0,
                               workload_check_interval=0.2, rank_termination_signal="SIGKILL",
                               install_exception_hook=True)
    sock = tmp_path / "rank0.socket"
    server = RankMonitorServer.run_in_subprocess(cfg, str(sock))
    try:
        assert sock.is_symlink()
        script = write_script(tmp_path / "rank.py", SERVER_RANK)
        env = {**os.environ, "FT_RANK_MONITOR_IPC_SOCKET": str(sock), "RANK": "0",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for name in ("NVRX_MONITOR_SOCKET", "NVRX_MONITOR_TOKEN", "NVRX_MONITOR_SHM"):
            env.pop(name, None)
        rank = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert "READY" in rank.stdout, rank.stderr
        cfg_line = next(line for line in rank.stdout.splitlines() if line.startswith("CFG "))
        assert json.loads(cfg_line[4:]) == {"hb": 1.0, "sig": "SIGKILL"}  # the client got the server's config
        assert rank.returncode == -signal.SIGKILL  # the hang was detected and the rank killed
        # the next rank process attaches to the same monitor; install_exception_hook reports its crash
        crash = subprocess.run([sys.executable, str(script), "crash"], env=env, capture_output=True, text=True,
                               timeout=60)
        assert crash.returncode == 1
        assert "rank 0: uncaught ZeroDivisionError: boom in step" in crash.stderr
        assert crash.stderr.rstrip().endswith("ZeroDivisionError: boom in step")  # then the usual traceback
    finally:
        server.terminate()
        server.join(10)
    assert server.exitcode is not None
    assert not sock.exists() and not sock.is_symlink()  # the monitor removed what it published


# ---------------------------------------------------------------- the client under nvrx launch, two jobs

FT_RANK = r'''
import json, os, sys, time
import torch.distributed as dist
from nvrx.monitors import RankMonitorClient, RankMonitorClientError

mode, state_path = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
client = RankMonitorClient()
if mode == "resume":
    with open(state_path) as fh:
        client.load_state_dict(json.load(fh))  # before init, as NVRx allows
client.init_workload_monitoring()

def report(tag, value):
    print(f"{tag} {rank} " + json.dumps(value, sort_keys=True, default=sorted), flush=True)

import dataclasses
report("START_HB", dataclasses.asdict(client.hb_timeouts))
report("START_SEC", dataclasses.asdict(client.section_timeouts))
if mode == "learn":
    try:
        client.calculate_and_set_hb_timeouts()
        report("EARLY", "set")
    except RankMonitorClientError as exc:
        report("EARLY", str(exc))
    report("EARLY_SKIP", client.calculate_and_set_hb_timeouts(skip_if_not_ready=True))
    for step in range(6):
        client.start_section("step")
        time.sleep(0.05 * (rank + 1))  # rank 1 is slower: the agreed timeouts must follow it
        client.end_section("step")
        time.sleep(0.1)  # out of section: learned x40 -> ~4 s, the second launch's budget between its calls
        client.send_heartbeat()
    client.start_section("ckpt")
    client.end_all_sections()
    client.start_section("ckpt")  # closed above, so it can be opened again
    client.end_section("ckpt")
    report("HB_SET", client.calculate_and_set_hb_timeouts())
    report("STEP_SET", client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False))
    report("ALL_SET", client.calculate_and_set_section_timeouts())
    report("HB", dataclasses.asdict(client.hb_timeouts))
    report("SEC", dataclasses.asdict(client.section_timeouts))
    state = client.state_dict()
    report("STATE", state["current_timeouts"])
    if rank == 0:
        with open(state_path, "w") as fh:
            json.dump(state, fh)
client.shutdown_workload_monitoring()
dist.destroy_process_group()
'''


def _reports(stdout: str, tag: str) -> dict[int, object]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith(tag + " "):
            _, rank, value = line.split(" ", 2)
            out[int(rank)] = json.loads(value)
    return out


def test_client_calls_across_two_launches(launcher, tmp_path: Path) -> None:
    script = write_script(tmp_path / "ft_rank.py", FT_RANK)
    state_path = tmp_path / "ft_state.json"
    first = launcher.run("--nproc-per-node", "2", "--rdzv-id", "ft-learn", "--state-dir", str(tmp_path / "s1"),
                         "--ft-enable-nic-monitor", "true",
                         # the learned timeouts are in force from the start of the second launch, whose ranks
                         # send no heartbeat: a factor that leaves seconds, not the 1 s floor, for a loaded host
                         "--ft-safety-factor", "40", str(script), "learn", str(state_path), timeout=180)
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "nvrx_logs" / "ft-learn"
    assert next(e for e in run_events(run_dir, "agent-") if e["ev"] == "ft_config")["config"]["enable_nic_monitor"]
    monitor_logs = [p.read_text() for p in run_dir.glob("monitor-*.log")]
    assert len(monitor_logs) == 2 and all("not acted on: enable_nic_monitor" in text for text in monitor_logs)
    start = _reports(first.stdout, "START_HB")
    assert start[0] == {"initial": 3600.0, "subsequent": 2700.0, "were_calculated": False}
    assert _reports(first.stdout, "EARLY") == {0: "Not enough data to compute timeouts.",
                                               1: "Not enough data to compute timeouts."}
    assert _reports(first.stdout, "EARLY_SKIP") == {0: False, 1: False}
    for tag in ("HB_SET", "STEP_SET", "ALL_SET"):
        assert _reports(first.stdout, tag) == {0: True, 1: True}, tag
    hb, sec, state = (_reports(first.stdout, t) for t in ("HB", "SEC", "STATE"))
    assert hb[0] == hb[1] and sec[0] == sec[1] and state[0] == state[1]  # collective: every rank agrees
    assert hb[0]["were_calculated"] and hb[0]["subsequent"] < 2700.0
    # rank 1's steps take ~0.1 s; times safety_factor 40 -> ~4 s (learned timeouts are at least 1 s)
    assert sec[0]["calculated_sections"] == ["ckpt", "step"] and sec[0]["is_out_of_section_calculated"]
    assert 1.0 <= sec[0]["section"]["step"] < 60.0
    assert state[0]["heartbeat"] == hb[0] and state[0]["section"]["section"] == sec[0]["section"]

    second = launcher.run("--nproc-per-node", "2", "--rdzv-id", "ft-resume", "--state-dir", str(tmp_path / "s2"),
                          str(script), "resume", str(state_path), timeout=180)
    assert second.returncode == 0, second.stderr
    resumed_hb, resumed_sec = _reports(second.stdout, "START_HB"), _reports(second.stdout, "START_SEC")
    assert resumed_hb[0] == resumed_hb[1] == hb[0]  # loaded before init, in force from the start
    assert resumed_sec[1]["section"] == sec[0]["section"] and resumed_sec[1]["calculated_sections"] == ["ckpt", "step"]
    assert launcher.leftovers() == []
