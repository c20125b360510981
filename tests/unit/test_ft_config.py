"""FaultToleranceConfig: spec defaults, layering, strict parsing with one-line hints, CLI flag extraction."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
from pathlib import Path

import pytest

from nvrx.common.errors import ConfigError
from nvrx.nvrx_cli.ft_args import extract_ft_args
from nvrx.monitors.ft_config import (SCHEMA, FaultToleranceConfig, config_table_markdown, describe,
                                ft_cli_flag_names, load_ft_config)


def one_line_error(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert msg and "\n" not in msg, msg
    return msg


def write(tmp_path: Path, text: str, name: str = "ft.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- defaults and schema


def test_defaults_match_spec():
    cfg = FaultToleranceConfig()
    assert cfg.workload_check_interval == 5.0
    assert cfg.initial_rank_heartbeat_timeout == 3600.0
    assert cfg.rank_heartbeat_timeout == 2700.0
    assert cfg.safety_factor == 5.0
    assert cfg.rank_termination_signal is signal.SIGKILL
    assert cfg.log_level == logging.INFO
    assert dict(cfg.rank_section_timeouts) == {}
    assert cfg.rank_out_of_section_timeout is None
    assert load_ft_config(None, {}, {}) == cfg


def test_schema_is_the_dataclass():
    assert [s.name for s in SCHEMA] == [f.name for f in dataclasses.fields(FaultToleranceConfig)]
    assert all(s.help for s in SCHEMA)


def test_mutable_with_validation_on_assignment_and_picklable():
    """NVRx code assigns settings (cfg.rank_heartbeat_timeout = 10.0); each assignment is validated like the
    constructor's arguments, and a refused one leaves the field as it was."""
    cfg = FaultToleranceConfig(rank_section_timeouts={"step": 30})
    cfg.rank_heartbeat_timeout = 10
    cfg.rank_termination_signal = "TERM"
    assert cfg.rank_heartbeat_timeout == 10.0 and isinstance(cfg.rank_heartbeat_timeout, float)
    assert cfg.rank_termination_signal is signal.SIGTERM
    with pytest.raises(ConfigError, match="rank_heartbeat_timeout.*greater than 0"):
        cfg.rank_heartbeat_timeout = -1
    assert cfg.rank_heartbeat_timeout == 10.0
    with pytest.raises(AttributeError, match="did you mean 'rank_heartbeat_timeout'"):
        cfg.rank_hearbeat_timeout = 5  # a typo must not create a stray attribute nobody reads
    with pytest.raises(TypeError):
        cfg.rank_section_timeouts["step"] = 1  # type: ignore[index]
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_constructor_validates_and_normalizes():
    cfg = FaultToleranceConfig(rank_termination_signal="TERM", log_level="debug", safety_factor=3)
    assert cfg.rank_termination_signal is signal.SIGTERM and cfg.log_level == logging.DEBUG
    assert isinstance(cfg.safety_factor, float)
    one_line_error(FaultToleranceConfig, rank_heartbeat_timeout=-1)


def test_to_dict_from_dict_round_trip():
    cfg = FaultToleranceConfig(rank_termination_signal=signal.SIGTERM, log_level=logging.WARNING,
                               rank_section_timeouts={"step": 30, "checkpointing": None},
                               rank_heartbeat_timeout=None)
    data = cfg.to_dict()
    assert data["rank_termination_signal"] == "SIGTERM"
    assert data["log_level"] == "WARNING"
    assert data["rank_section_timeouts"] == {"step": 30.0, "checkpointing": None}
    text = json.dumps(data)  # JSON-safe
    assert FaultToleranceConfig.from_dict(json.loads(text)) == cfg
    assert FaultToleranceConfig(log_level=15).to_dict()["log_level"] == 15  # no standard name


def test_from_dict_is_strict():
    msg = one_line_error(FaultToleranceConfig.from_dict, {"safety_factr": 2})
    assert "safety_factor" in msg
    one_line_error(FaultToleranceConfig.from_dict, {"safety_factor": "x"})
    one_line_error(FaultToleranceConfig.from_dict, ["safety_factor"])


# ---------------------------------------------------------------- layering


def test_precedence_each_layer_visible(tmp_path):
    path = write(tmp_path, "fault_tolerance:\n"
                           "  workload_check_interval: 1\n"
                           "  initial_rank_heartbeat_timeout: 100\n"
                           "  rank_heartbeat_timeout: 200\n"
                           "  safety_factor: 2\n")
    env = {"NVRX_FT_INITIAL_RANK_HEARTBEAT_TIMEOUT": "111", "NVRX_FT_RANK_HEARTBEAT_TIMEOUT": "222",
           "NVRX_FT_LOG_LEVEL": "DEBUG", "UNRELATED": "x"}
    cli = {"rank_heartbeat_timeout": "333", "rank_termination_signal": "SIGTERM"}
    cfg = load_ft_config(path, env, cli)
    assert cfg.workload_check_interval == 1.0  # YAML only
    assert cfg.safety_factor == 2.0  # YAML only
    assert cfg.initial_rank_heartbeat_timeout == 111.0  # env over YAML
    assert cfg.log_level == logging.DEBUG  # env only
    assert cfg.rank_heartbeat_timeout == 333.0  # CLI over env over YAML
    assert cfg.rank_termination_signal is signal.SIGTERM  # CLI only
    assert cfg.rank_out_of_section_timeout is None  # default


def test_later_layer_can_reset_timeout_to_null(tmp_path):
    path = write(tmp_path, "rank_heartbeat_timeout: 10\n")
    assert load_ft_config(path, {}, {"rank_heartbeat_timeout": "null"}).rank_heartbeat_timeout is None
    assert load_ft_config(path, {"NVRX_FT_RANK_HEARTBEAT_TIMEOUT": "none"}, {}).rank_heartbeat_timeout is None


def test_empty_env_variable_counts_as_unset():
    assert load_ft_config(None, {"NVRX_FT_SAFETY_FACTOR": ""}, {}).safety_factor == 5.0


def test_misspelled_env_variable_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="nvrx.monitors.ft_config"):
        load_ft_config(None, {"NVRX_FT_SAFETY_FACTR": "2"}, {})
    assert "NVRX_FT_SAFETY_FACTOR" in caplog.text


def test_yaml_top_key_and_bare_mapping(tmp_path):
    nested = write(tmp_path, "fault_tolerance:\n  rank_heartbeat_timeout: 60\n  log_level: WARNING\n", "a.yaml")
    bare = write(tmp_path, "rank_heartbeat_timeout: 60\nlog_level: WARNING\n", "b.yaml")
    a, b = load_ft_config(nested, {}, {}), load_ft_config(bare, {}, {})
    assert a == b
    assert a.rank_heartbeat_timeout == 60.0 and a.log_level == logging.WARNING


def test_yaml_nulls_and_sections(tmp_path):
    path = write(tmp_path, "fault_tolerance:\n"
                           "  initial_rank_heartbeat_timeout: null\n"
                           "  rank_section_timeouts: {setup: 600, step: 30, checkpointing: null}\n"
                           "  rank_out_of_section_timeout: 120\n")
    cfg = load_ft_config(path, {}, {})
    assert cfg.initial_rank_heartbeat_timeout is None
    assert dict(cfg.rank_section_timeouts) == {"setup": 600.0, "step": 30.0, "checkpointing": None}
    assert cfg.rank_out_of_section_timeout == 120.0


# ---------------------------------------------------------------- bad YAML never falls back to defaults


def test_missing_file():
    msg = one_line_error(load_ft_config, "/nonexistent/ft.yaml", {}, {})
    assert "/nonexistent/ft.yaml" in msg and "does not exist" in msg


def test_directory_instead_of_file(tmp_path):
    assert "directory" in one_line_error(load_ft_config, str(tmp_path), {}, {})


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read anything")
def test_unreadable_file(tmp_path):
    path = write(tmp_path, "safety_factor: 2\n")
    os.chmod(path, 0)
    assert "cannot read" in one_line_error(load_ft_config, path, {}, {})


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "fault_tolerance:\n  safety_factor: 2\n  log_level: [INFO\n")
    msg = one_line_error(load_ft_config, path, {}, {})
    assert "YAML syntax error" in msg and "line " in msg


def test_yaml_duplicate_key(tmp_path):
    path = write(tmp_path, "safety_factor: 2\nsafety_factor: 3\n")
    msg = one_line_error(load_ft_config, path, {}, {})
    assert "duplicate key" in msg and "line 2" in msg


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "42\n", "", "fault_tolerance:\n",
                                  "fault_tolerance: [1]\n"])
def test_yaml_not_a_mapping(tmp_path, text):
    msg = one_line_error(load_ft_config, write(tmp_path, text), {}, {})
    assert "mapping" in msg or "empty" in msg


def test_yaml_unknown_key_suggests_closest(tmp_path):
    msg = one_line_error(load_ft_config, write(tmp_path, "fault_tolerance:\n  rank_hearbeat_timeout: 5\n"), {}, {})
    assert "rank_hearbeat_timeout" in msg and "rank_heartbeat_timeout" in msg
    msg = one_line_error(load_ft_config, write(tmp_path, "rank-heartbeat-timeout: 5\n"), {}, {})
    assert "rank_heartbeat_timeout" in msg
    msg = one_line_error(load_ft_config, write(tmp_path, "fault_tolerence:\n  safety_factor: 2\n"), {}, {})
    assert "'fault_tolerance'" in msg


def test_yaml_stray_key_next_to_section(tmp_path):
    path = write(tmp_path, "fault_tolerance:\n  safety_factor: 2\nsafety_factor: 3\n")
    assert "move it under" in one_line_error(load_ft_config, path, {}, {})


def test_yaml_bad_value_names_file_and_key(tmp_path):
    path = write(tmp_path, "fault_tolerance:\n  rank_heartbeat_timeout: -5\n")
    msg = one_line_error(load_ft_config, path, {}, {})
    assert path in msg and "rank_heartbeat_timeout" in msg and "greater than 0" in msg


# ---------------------------------------------------------------- value parsing


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "nan", "inf", "", True])
def test_bad_timeouts(bad):
    msg = one_line_error(load_ft_config, None, {}, {"rank_heartbeat_timeout": bad})
    assert "--ft-param-rank_heartbeat_timeout" in msg and "positive number" in msg


def test_null_not_allowed_where_not_optional():
    msg = one_line_error(load_ft_config, None, {}, {"workload_check_interval": "null"})
    assert "null is not allowed" in msg
    msg = one_line_error(load_ft_config, None, {"NVRX_FT_SAFETY_FACTOR": "none"}, {})
    assert "NVRX_FT_SAFETY_FACTOR" in msg


def test_env_error_names_variable():
    msg = one_line_error(load_ft_config, None, {"NVRX_FT_WORKLOAD_CHECK_INTERVAL": "fast"}, {})
    assert "NVRX_FT_WORKLOAD_CHECK_INTERVAL" in msg and "'fast'" in msg


@pytest.mark.parametrize("raw", ["SIGTERM", "TERM", "term", "15", 15, signal.SIGTERM])
def test_signal_spellings(raw):
    assert FaultToleranceConfig(rank_termination_signal=raw).rank_termination_signal is signal.SIGTERM


def test_bad_signals():
    msg = one_line_error(load_ft_config, None, {}, {"rank_termination_signal": "SIGTREM"})
    assert "SIGTERM" in msg
    assert "signal number" in one_line_error(load_ft_config, None, {}, {"rank_termination_signal": "999"})
    assert "does not terminate" in one_line_error(load_ft_config, None, {}, {"rank_termination_signal": "STOP"})


@pytest.mark.parametrize("raw,level", [("INFO", 20), ("debug", 10), ("WARN", 30), ("15", 15), (40, 40)])
def test_log_levels(raw, level):
    assert FaultToleranceConfig(log_level=raw).log_level == level


def test_bad_log_level():
    msg = one_line_error(load_ft_config, None, {}, {"log_level": "INFOO"})
    assert "INFO" in msg and "did you mean" in msg
    one_line_error(load_ft_config, None, {}, {"log_level": "-3"})


@pytest.mark.parametrize("raw", ["step:30,checkpointing:600,setup:null",
                                 "step=30, checkpointing=600, setup=none",
                                 '{"step": 30, "checkpointing": 600, "setup": null}',
                                 "{step: 30, checkpointing: 600, setup: ~}"])
def test_section_mapping_syntaxes(raw):
    cfg = load_ft_config(None, {}, {"rank_section_timeouts": raw})
    assert dict(cfg.rank_section_timeouts) == {"step": 30.0, "checkpointing": 600.0, "setup": None}


def test_section_mapping_from_env():
    cfg = load_ft_config(None, {"NVRX_FT_RANK_SECTION_TIMEOUTS": "step:5"}, {})
    assert dict(cfg.rank_section_timeouts) == {"step": 5.0}


@pytest.mark.parametrize("raw,hint", [
    ("step", "SECTION:SECONDS"),
    ("step:", "SECTION:SECONDS"),
    ("step:30,step:40", "twice"),
    ("step:-4", "greater than 0"),
    ("step:abc", "not a number"),
    ('{"step": 30', "inline mapping"),
    ("{1: 30}", "section name"),
    ("[1, 2]", "SECTION:SECONDS"),
])
def test_bad_section_mappings(raw, hint):
    msg = one_line_error(load_ft_config, None, {}, {"rank_section_timeouts": raw})
    assert hint in msg


def test_section_mapping_must_be_a_mapping_in_yaml(tmp_path):
    path = write(tmp_path, "rank_section_timeouts: [step, 30]\n")
    assert "not a mapping" in one_line_error(load_ft_config, path, {}, {})


def test_unknown_cli_override_key():
    msg = one_line_error(load_ft_config, None, {}, {"safety_facter": "2"})
    assert "--ft-param-safety_factor" in msg


# ---------------------------------------------------------------- CLI flags


def test_flag_spellings():
    flags = ft_cli_flag_names()
    assert set(flags) == {s.name for s in SCHEMA}
    assert flags["rank_heartbeat_timeout"] == (
        "--ft-param-rank_heartbeat_timeout", "--ft-param-rank-heartbeat-timeout",
        "--ft-rank_heartbeat_timeout", "--ft-rank-heartbeat-timeout")


def test_extract_both_forms_keeps_other_args():
    argv = ["--nproc-per-node", "2", "--ft-param-rank_heartbeat_timeout", "60", "--standalone",
            "--ft-param-safety-factor=3", "--max-restarts=1", "--ft-rank-termination-signal", "TERM",
            "--ft-log_level=DEBUG", "--ft-cfg-path", "ft.yaml"]
    overrides, rest = extract_ft_args(argv)
    assert overrides == {"rank_heartbeat_timeout": "60", "safety_factor": "3",
                         "rank_termination_signal": "TERM", "log_level": "DEBUG"}
    assert rest == ["--nproc-per-node", "2", "--standalone", "--max-restarts=1", "--ft-cfg-path", "ft.yaml"]
    cfg = load_ft_config(None, {}, overrides)
    assert cfg.rank_heartbeat_timeout == 60.0 and cfg.rank_termination_signal is signal.SIGTERM


def test_extract_value_may_look_odd():
    overrides, _ = extract_ft_args(["--ft-param-rank_section_timeouts", '{"step": 30}',
                                    "--ft-param-safety_factor", "-1"])
    assert overrides == {"rank_section_timeouts": '{"step": 30}', "safety_factor": "-1"}
    assert "greater than 0" in one_line_error(load_ft_config, None, {}, overrides)


def test_extract_stops_at_script_and_double_dash():
    argv = ["--nnodes", "1", "train.py", "--ft-param-safety_factor", "9"]
    assert extract_ft_args(argv) == ({}, argv)
    argv = ["--standalone", "--", "--ft-param-safety_factor", "9"]
    assert extract_ft_args(argv) == ({}, argv)
    # with the launcher's value-taking options known, a bare word after a boolean flag is the script
    argv = ["--standalone", "train.py", "--ft-param-safety_factor", "9"]
    assert extract_ft_args(argv, value_flags={"--nnodes"}) == ({}, argv)


def test_extract_unknown_flag_suggests_closest():
    msg = one_line_error(extract_ft_args, ["--ft-param-rank_hearbeat_timeout", "5"])
    assert "--ft-param-rank_heartbeat_timeout" in msg
    msg = one_line_error(extract_ft_args, ["--ft-safety-facter=2"])
    assert "--ft-safety-factor" in msg


@pytest.mark.parametrize("argv", [["--ft-param-safety_factor"], ["--ft-param-safety_factor="],
                                  ["--ft-param-safety_factor", "--standalone"]])
def test_extract_missing_value(argv):
    assert "needs a value" in one_line_error(extract_ft_args, argv)


def test_extract_same_setting_twice():
    msg = one_line_error(extract_ft_args, ["--ft-param-safety_factor", "2", "--ft-safety-factor=3"])
    assert "once" in msg


# ---------------------------------------------------------------- output


def test_describe_is_one_line():
    cfg = FaultToleranceConfig(rank_section_timeouts={"step": 30, "ckpt": None})
    line = describe(cfg)
    assert "\n" not in line
    for s in SCHEMA:
        assert s.name + "=" in line
    assert "SIGKILL" in line and "INFO" in line and "step: 30s" in line and "ckpt: auto" in line


def test_table_contains_every_field():
    table = config_table_markdown()
    for s in SCHEMA:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{s.name}` "))
        assert s.env_name in row and s.flag in row
    assert "NVRX_FT_RANK_SECTION_TIMEOUTS" in table and "`3600.0`" in table and "`SIGKILL`" in table


# ---------------------------------------------------------------- ranges and the monitor's section limits


@pytest.mark.parametrize("field,raw,hint", [
    ("workload_check_interval", "1e308", "too large"),      # overflowed the monitor's select() at run time
    ("workload_check_interval", "86401", "too large"),
    ("workload_check_interval", "0.001", "at least 0.01"),
    ("rank_heartbeat_timeout", "1e308", "too large"),
    ("initial_rank_heartbeat_timeout", "1e12", "too large"),
    ("rank_out_of_section_timeout", "1e300", "too large"),
    ("safety_factor", "1e9", "too large"),
    ("safety_factor", "1e400", "finite"),
])
def test_values_out_of_range(field, raw, hint):
    msg = one_line_error(load_ft_config, None, {}, {field: raw})
    assert field in msg and hint in msg


def test_range_edges_are_accepted():
    cfg = load_ft_config(None, {}, {"workload_check_interval": "0.01", "rank_heartbeat_timeout": "315360000",
                                    "safety_factor": "1000"})
    assert cfg.workload_check_interval == 0.01 and cfg.safety_factor == 1000.0
    assert load_ft_config(None, {}, {"workload_check_interval": "86400"}).workload_check_interval == 86400.0


def test_section_names_use_the_monitors_rule():
    from nvrx.monitors.sections import validate_section_name

    ok = ["step", "a" * 64, "nvrx.ckpt.save", "io/read", "1st"]
    for name in ok:
        validate_section_name(name)
        assert name in load_ft_config(None, {}, {"rank_section_timeouts": json.dumps({name: 5})}).rank_section_timeouts
    for bad in ["a" * 65, "bad name", "tab\there", "é"]:
        msg = one_line_error(FaultToleranceConfig, rank_section_timeouts={bad: 5})
        assert "rank_section_timeouts" in msg and "1-64 characters" in msg
        with pytest.raises(ValueError):
            validate_section_name(bad)


def test_section_count_is_bounded_by_the_slot():
    from nvrx.monitors.heartbeat import MAX_SECTIONS

    full = {f"s{i}": 1 for i in range(MAX_SECTIONS)}
    assert len(FaultToleranceConfig(rank_section_timeouts=full).rank_section_timeouts) == MAX_SECTIONS
    msg = one_line_error(FaultToleranceConfig, rank_section_timeouts={**full, "one_more": 1})
    assert f"{MAX_SECTIONS + 1} sections" in msg and f"at most {MAX_SECTIONS}" in msg
    path_msg = one_line_error(load_ft_config, None, {"NVRX_FT_RANK_SECTION_TIMEOUTS": ",".join(
        f"s{i}:1" for i in range(MAX_SECTIONS + 1))}, {})
    assert "NVRX_FT_RANK_SECTION_TIMEOUTS" in path_msg


def test_learned_timeouts_stay_within_the_configurable_range():
    from nvrx.monitors.sections import SectionStats
    from nvrx.monitors.timeouts import MAX_TIMEOUT_SECONDS, HeartbeatStats, TimeoutTracker, Timeouts

    tracker = TimeoutTracker(Timeouts(), safety_factor=1000.0)
    tracker.set_run_observations(HeartbeatStats(1e7, 1e7), SectionStats())
    tracker.calculate_and_set()
    assert tracker.in_force().heartbeat == MAX_TIMEOUT_SECONDS
    FaultToleranceConfig(rank_heartbeat_timeout=tracker.in_force().heartbeat)  # still a valid setting


def test_nvrx_only_settings_have_flags_env_and_yaml_like_the_others(tmp_path):
    path = write(tmp_path, "fault_tolerance:\n  enable_nic_monitor: true\n  segment: 2\n")
    cfg = load_ft_config(path, {"NVRX_FT_NUM_WARMUP_ITERATIONS": "9"}, {"max_no_progress_cycles": "0"})
    assert (cfg.enable_nic_monitor, cfg.segment, cfg.num_warmup_iterations, cfg.max_no_progress_cycles) == \
        (True, 2, 9, 0)
    assert not cfg.is_progress_tracking_enabled
    assert "--ft-param-gpu-memory-tolerance-mb" in ft_cli_flag_names()["gpu_memory_tolerance_mb"]
    assert FaultToleranceConfig.from_dict(cfg.to_dict()) == cfg


def test_the_monitor_start_line_names_what_nvrx_does_not_do(monkeypatch):
    from nvrx.monitors import ft_config

    monkeypatch.setattr(ft_config, "gpu_visible", lambda: False)
    line = ft_config.inactive_settings_line(FaultToleranceConfig())
    assert "GPU health checks every 5s (no GPU on this node" in line and "not acted on" not in line
    monkeypatch.setattr(ft_config, "gpu_visible", lambda: True)  # the GPU path behind the seam
    line = ft_config.inactive_settings_line(FaultToleranceConfig(enable_nic_monitor=True, numa_bind_strict=True))
    assert "a GPU is visible" in line and line.endswith("not acted on: enable_nic_monitor, numa_bind_strict")
    assert "\n" not in line
