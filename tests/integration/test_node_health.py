"""Node health checks: each check's verdicts and their time bound (a failing node sitting out a real job, on
emulated hosts: tests/hosts_e2e/test_rounds.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil

from nvrx.launcher.agent import node_health
from nvrx.launcher.agent.node_health import FAILED, OK, SKIPPED, WARNING, NodeHealthChecks
from nvrx.events import EventLog, HealthCheckInfo, NodeHealth
from nvrx.monitors.ft_config import FaultToleranceConfig
from nvrx.slurm.nodes import find_bad_node
from tests.conftest import wait_for, write_script


def _report(tmp_path: Path, **ft) -> dict[str, node_health.CheckResult]:
    report = NodeHealthChecks(FaultToleranceConfig(**ft), tmp_path).run()
    return {r.name: r for r in report.results}


def test_built_in_checks_pass_on_a_healthy_node(tmp_path):
    results = _report(tmp_path, enable_dist_storage_healthcheck=True, storage_healthcheck_path=str(tmp_path))
    assert {n: r.status for n, r in results.items() if n != "gpu"} == {"memory": OK, "disk": OK, "storage": OK}
    assert list(tmp_path.iterdir()) == []  # the storage probe cleans up after itself
    if not os.path.exists("/dev/nvidia0"):
        assert (results["gpu"].status, results["gpu"].detail) == (SKIPPED, "no GPU")


def test_each_check_fails_with_the_reason(tmp_path):
    results = _report(tmp_path, node_health_min_free_memory_mb=1e9, node_health_min_free_disk_mb=1e9,
                      enable_dist_storage_healthcheck=True, storage_healthcheck_path=str(tmp_path / "missing"),
                      node_health_check_hook=f"{sys.executable} -c 'import sys; print(\"fan broken\"); sys.exit(3)'")
    assert all(r.status == FAILED for r in results.values() if r.name not in ("gpu", "disk")), results
    assert results["disk"].status == WARNING  # space for logs: said, never a failed node (events are diagnostics)
    assert "below" in results["memory"].detail and "below" in results["disk"].detail
    assert "missing" in results["storage"].detail
    assert results["hook"].detail == "hook exited 3: fan broken"


def test_nic_links_from_sysfs_states(tmp_path):
    for dev, state in (("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")):
        (tmp_path / dev).mkdir()
        (tmp_path / dev / "state").write_text(state + "\n")
    template = str(tmp_path / "{}" / "state")
    status, detail = node_health.check_ib_links(template)
    assert status == FAILED and "1 of 2" in detail and "mlx5_1" in detail
    (tmp_path / "mlx5_1" / "state").write_text("4: ACTIVE\n")
    assert node_health.check_ib_links(template)[0] == OK
    assert node_health.check_ib_links(str(tmp_path / "none" / "{}"))[0] == SKIPPED


def test_gpu_check_goes_through_nvidia_smi(tmp_path):
    # nvidia-smi cannot exist here: the real code path runs a stand-in program in its place (the seam)
    good = write_script(tmp_path / "smi_ok", "#!/bin/sh\necho '0, NVIDIA H100, 00000000:18:00.0'\n")
    bad = write_script(tmp_path / "smi_bad", "#!/bin/sh\necho 'Unable to determine the device handle' >&2\nexit 15\n")
    for script in (good, bad):
        script.chmod(0o755)
    assert node_health.check_gpus(5, smi=str(good)) == (OK, "1 GPU(s) answer")
    status, detail = node_health.check_gpus(5, smi=str(bad))
    assert status == FAILED and "exited 15" in detail and "device handle" in detail


def test_python_callable_hook(tmp_path, monkeypatch):
    (tmp_path / "myhealth.py").write_text("def good():\n    return None\ndef bad():\n    return False\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert node_health.run_hook("myhealth:good", 30)[0] == OK
    assert node_health.run_hook("myhealth:bad", 30) == (FAILED, "hook exited 1")


def test_a_hung_hook_is_bounded_and_leaves_no_process(tmp_path):
    marker = "31.4159"
    t0 = time.monotonic()
    results = _report(tmp_path, node_health_check_hook=f"sh -c 'sleep {marker}; true'", node_health_check_timeout=1)
    assert time.monotonic() - t0 < 10  # bounded: not the hook's 31 s
    assert results["hook"].status == FAILED and "did not finish in 1 s" in results["hook"].detail
    assert wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])],
                    timeout=5)


def test_nvrx_resume_excludes_a_node_that_failed_its_health_checks(tmp_path):
    run = tmp_path / "logs" / "job7"
    run.mkdir(parents=True)
    log = EventLog(run / "agent-node-b-4242.jsonl", source="agent")
    log.emit(NodeHealth(ok=False, seconds=0.1, action="sits out",
                        checks=[HealthCheckInfo(name="hook", status="failed", detail="hook exited 1", seconds=0.1)]))
    log.close()
    assert find_bad_node(tmp_path / "logs", "job7") == "node-b"

