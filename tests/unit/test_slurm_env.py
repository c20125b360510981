"""Slurm environment -> launch topology: hostlist expansion, step/batch topology, the config block."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from nvrx.launcher.agent.config import build_launch_config
from nvrx.common.errors import ConfigError
from nvrx.slurm.environment import (RDZV_PORT_BASE, RDZV_PORT_SPAN, SlurmEnvError, expand_hostlist, parse_tasks_per_node,
                                rdzv_port_for_job, slurm_topology)

HOSTLISTS = {
    "gpu-[001-004,010],login1": ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-010", "login1"],
    "node7": ["node7"],
    "n[9-11]": ["n9", "n10", "n11"],
    "n[01-10]": [f"n{i:02d}" for i in range(1, 11)],
    "n[1-010]": [f"n{i}" for i in range(1, 11)],  # the low bound sets the width
    "n[0001-3]": ["n0001", "n0002", "n0003"],
    "n[007]": ["n007"],
    "r[1-2]n[3-4]": ["r1n3", "r1n4", "r2n3", "r2n4"],
    "n-[1-3]-[01-02]": ["n-1-01", "n-1-02", "n-2-01", "n-2-02", "n-3-01", "n-3-02"],
    "a[1-2],b[5,7-8],c": ["a1", "a2", "b5", "b7", "b8", "c"],
    "n[1-3,2]": ["n1", "n2", "n3", "n2"],  # Slurm keeps duplicates and order
    "[1-2]": ["1", "2"],
    "a,,b": ["a", "b"],
    "n1 n2": ["n1", "n2"],
    "nvrx-n[1-2]": ["nvrx-n1", "nvrx-n2"],
}

BAD_HOSTLISTS = {
    "n[1-2": "never closed",
    "n1-2]": "without a matching",
    "n[1-[2]]": "cannot nest",
    "n[3-1]": "backwards",
    "n[]": "not a number",
    "n[a]": "not a number",
    "n[1-2x]": "not a number",
    "n[0-99999999]": "more than",
    "n[0-999]m[0-999]": "more than",
    "": "no host",
    " , ": "no host",
}


@pytest.mark.parametrize("text,expected", HOSTLISTS.items())
def test_expand_hostlist(text, expected):
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize("text,message", BAD_HOSTLISTS.items())
def test_bad_hostlist_is_one_clear_line(text, message):
    with pytest.raises(SlurmEnvError, match=message) as err:
        expand_hostlist(text)
    assert "\n" not in str(err.value)


@pytest.mark.integration  # starts a process / opens a socket
@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed (scripts/install_slurm.sh)")
def test_hostlists_agree_with_scontrol(tmp_path):
    """`scontrol show hostnames` needs only a config file to read, not a running controller."""
    conf = tmp_path / "nvrx.slurm.conf"
    conf.write_text("ClusterName=hostlistcheck\nSlurmctldHost=localhost\n")
    for text, expected in HOSTLISTS.items():
        out = subprocess.run(["scontrol", "show", "hostnames", text], env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=20)
        assert out.stdout.split() == expand_hostlist(text) == expected, (text, out.stderr)


def test_tasks_per_node():
    assert parse_tasks_per_node("1(x2)") == [1, 1]
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("8") == [8]
    with pytest.raises(SlurmEnvError, match="not N or N"):
        parse_tasks_per_node("two")


def test_rdzv_port_differs_between_consecutive_jobs():
    ports = [rdzv_port_for_job(str(j)) for j in range(41, 61)]
    assert len(set(ports)) == len(ports)
    assert all(RDZV_PORT_BASE <= p < RDZV_PORT_BASE + RDZV_PORT_SPAN for p in ports)
    assert RDZV_PORT_BASE <= rdzv_port_for_job("abc") < RDZV_PORT_BASE + RDZV_PORT_SPAN


# What srun --ntasks-per-node=1 gives node 1 of a 2-node step (taken from the test Slurm).
STEP_ENV = {
    "SLURM_JOB_ID": "42", "SLURM_JOBID": "42", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_JOB_NODELIST": "nvrx-n[1-3]", "SLURM_JOB_NUM_NODES": "3",
    "SLURM_STEP_NODELIST": "nvrx-n[2-3]", "SLURM_NODELIST": "nvrx-n[2-3]", "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURMD_NODENAME": "nvrx-n3",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)",
}
BATCH_ENV = {
    "SLURM_JOB_ID": "43", "SLURM_JOB_NODELIST": "nvrx-n1", "SLURM_NODELIST": "nvrx-n1", "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "nvrx-n1", "SLURM_TASKS_PER_NODE": "4",
}


def test_topology_of_a_step_uses_the_step_nodes():
    topo = slurm_topology(STEP_ENV)
    assert topo.hosts == ("nvrx-n2", "nvrx-n3") and topo.nnodes == 2
    assert topo.node_rank == 1 and topo.rdzv_host == "nvrx-n2" and topo.node_name == "nvrx-n3"
    assert topo.in_step and topo.tasks_per_node == 1 and topo.job_id == "42"


def test_topology_outside_slurm_and_in_a_batch_script():
    assert slurm_topology({"PATH": "/bin"}) is None
    topo = slurm_topology(BATCH_ENV)
    assert not topo.in_step and topo.nnodes == 1 and topo.node_rank == 0
    assert topo.tasks_per_node == 1  # the batch script is one process whatever the job asked for


@pytest.mark.parametrize("change,message", [
    ({"SLURM_STEP_NUM_NODES": "3"}, "says 3 nodes"),
    ({"SLURM_NODEID": "5"}, "outside the node list"),
    ({"SLURM_NODEID": "x"}, "not a whole number"),
    ({"SLURM_STEP_NODELIST": "nvrx-n[2-"}, "never closed"),
])
def test_inconsistent_slurm_env(change, message):
    with pytest.raises(SlurmEnvError, match=message):
        slurm_topology({**STEP_ENV, **change})


# ---------------------------------------------------------------- wired into the launch config


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_launch_config_from_a_slurm_step(script):
    cfg = build_launch_config({"training_script": script, "nproc_per_node": "2"}, STEP_ENV)
    r = cfg.rdzv
    assert (r.min_nodes, r.max_nodes, r.node_rank, r.run_id) == (2, 2, 1, "42")
    assert (r.host, r.port) == ("nvrx-n2", rdzv_port_for_job("42")) and not r.standalone
    assert cfg.node_name == "nvrx-n3" and cfg.slurm.job_id == "42"
    assert cfg.run_log_dir.name == "42"


def test_explicit_flags_win(script):
    raw = {"training_script": script, "nnodes": "1:2", "rdzv_id": "mine"}
    cfg = build_launch_config(raw, STEP_ENV)
    assert (cfg.rdzv.min_nodes, cfg.rdzv.max_nodes, cfg.rdzv.run_id) == (1, 2, "mine")
    assert cfg.rdzv.node_rank is None  # an elastic range gets ranks per round, not Slurm's node id
    cfg = build_launch_config({"training_script": script, "nnodes": "2", "rdzv_endpoint": "h:1234"}, STEP_ENV)
    assert (cfg.rdzv.host, cfg.rdzv.port, cfg.rdzv.run_id, cfg.slurm) == ("h", 1234, "none", None)
    cfg = build_launch_config({"training_script": script, "standalone": True}, STEP_ENV)
    assert cfg.rdzv.standalone and cfg.slurm is None


def test_single_node_job_runs_standalone_with_the_job_id(script):
    cfg = build_launch_config({"training_script": script}, BATCH_ENV)
    assert cfg.rdzv.standalone and cfg.rdzv.max_nodes == 1 and cfg.rdzv.run_id == "43"


def test_several_tasks_per_node_is_refused(script):
    env = {**STEP_ENV, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(ConfigError, match=r"one nvrx launch per node: use srun --ntasks-per-node=1"):
        build_launch_config({"training_script": script}, env)


def test_batch_script_of_a_multi_node_job_is_refused(script):
    env = {**BATCH_ENV, "SLURM_JOB_NODELIST": "nvrx-n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    with pytest.raises(ConfigError, match="batch script of a 2-node job"):
        build_launch_config({"training_script": script}, env)
    cfg = build_launch_config({"training_script": script, "nnodes": "1"}, env)
    assert cfg.rdzv.standalone and cfg.rdzv.run_id == "43"
