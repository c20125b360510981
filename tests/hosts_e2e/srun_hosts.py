"""What ``srun --ntasks-per-node=1 nvrx launch ...`` is in a Slurm job, for emulated hosts: run one command on
each host at once, wait for all of them, exit with the highest exit status (a signal's as 128 + its number).

    python -m tests.hosts_e2e.srun_hosts SPEC -- CMD...

SPEC: a JSON file, a list of hosts, each ``{"name": ..., "prefix": [...]}`` (``tests.hosts.Host.prefix()``).
SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 are passed on to every task. Each task's end is appended to
``SPEC.ends.jsonl`` (host, exit status, wall time), so a test can tell which host ended how, and when.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m tests.hosts_e2e.srun_hosts SPEC -- CMD...", file=sys.stderr)
        return 2
    spec = Path(argv[1])
    hosts = json.loads(spec.read_text())
    tasks = {h["name"]: subprocess.Popen([*h["prefix"], *argv[3:]]) for h in hosts}

    def forward(signum: int, _frame) -> None:
        for proc in tasks.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    worst = 0
    pending = dict(tasks)
    while pending:
        pid, status = os.wait()
        name = next((n for n, p in pending.items() if p.pid == pid), None)
        if name is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
        pending.pop(name).returncode = code
        with open(spec.with_name(spec.name + ".ends.jsonl"), "a") as fh:
            fh.write(json.dumps({"host": name, "rc": code, "t": time.time()}) + "\n")
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv))
