"""Logging as the spec describes: the Wrapper's own stderr handler, no propagation to the application's
root logger, no files in the rank; the monitor process writes only to its log file."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from nvrx.launcher.rank.inprocess.log_setup import LOGGER_NAME, setup_rank_logging
from tests.conftest import REPO, free_port

SCRIPT = """
import json, logging, sys
logging.basicConfig(filename=sys.argv[1], level=logging.DEBUG, format="ROOT %(name)s %(message)s")
from nvrx.launcher.rank import inprocess
@inprocess.Wrapper(monitor_process_logfile=sys.argv[2], soft_timeout=5, hard_timeout=10, heartbeat_timeout=5)
def train(call_wrapper=None):
    logging.getLogger("app").info("app record in iteration %d", call_wrapper.iteration)
    if call_wrapper.iteration == 0:
        raise RuntimeError("first attempt fails")
    return "ok"


result = train()
logger = logging.getLogger("nvrx.launcher.rank.inprocess")
print(json.dumps({"result": result, "propagate": logger.propagate,
                  "handlers": [type(h).__name__ for h in logger.handlers]}))
"""


def test_rank_logs_to_its_own_stderr_handler_and_the_monitor_process_only_to_its_file(tmp_path):
    root_log, monitor_log, script = tmp_path / "root.log", tmp_path / "monitor{rank}.log", tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=os.pathsep.join(filter(None, (str(REPO),
                                                                                    os.environ.get("PYTHONPATH")))))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    res = subprocess.run([sys.executable, str(script), str(root_log), str(monitor_log)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"result": "ok", "propagate": False, "handlers": ["StreamHandler"]}

    root = root_log.read_text()
    assert "app record in iteration 0" in root and "app record in iteration 1" in root
    assert "nvrx.launcher.rank.inprocess" not in root and "restarting" not in root, "Wrapper records reached the root logger"

    assert "fault in iteration 0: RuntimeError: first attempt fails" in res.stderr
    assert "restarting after iteration 0" in res.stderr
    assert "inprocess-monitor[" not in res.stderr and "monitoring pid" not in res.stderr

    monitor = (tmp_path / "monitor0.log").read_text()
    assert "monitoring pid" in monitor and "stopped by the rank" in monitor
    assert all("inprocess-monitor[" in line for line in monitor.splitlines() if " INFO " in line)
    assert "restarting after iteration" not in monitor, "the rank's records went to the monitor's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["monitor0.log", "root.log", "train.py"]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_setup_rank_logging_adds_one_handler_and_stops_propagation():
    logger = logging.getLogger(LOGGER_NAME)
    root = logging.getLogger()
    saved = (logger.handlers[:], logger.propagate, logger.level)
    app = _Collect()  # what an application's root-logger configuration would receive
    root.addHandler(app)
    try:
        setup_rank_logging()
        setup_rank_logging()
        ours = [h for h in logger.handlers if getattr(h, "_inprocess", False)]
        assert len(ours) == 1 and type(ours[0]) is logging.StreamHandler and not logger.propagate
        logging.getLogger(LOGGER_NAME + ".session").warning("isolated record")
        logging.getLogger("someone.else").warning("application record")
        assert app.messages == ["application record"]  # ours never reaches the root logger's handlers
    finally:
        root.removeHandler(app)
        logger.handlers[:], logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
