"""Continue a run in a new Slurm job: `sbatch --dependency=afterany:JOB` or `scontrol requeue JOB`.

Every call is bounded (timeout) and its failure is one line. The environment (PATH, SLURM_CONF) and
the job's facts come from the caller; nothing here reads os.environ.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from nvrx.common.errors import NvrxError
log = logging.getLogger("nvrx.resume")

Runner = Callable[..., subprocess.CompletedProcess]


class SlurmSetupError(NvrxError):
    """A missing tool or an unknown batch script: found before anything runs (usage error)."""


class SubmitError(NvrxError):
    """sbatch/scontrol failed or did not answer: the run should continue but nothing was submitted."""


@dataclass(frozen=True)
class SubmitSettings:
    """How to continue in a new job: sbatch a continuation (after this job), or requeue this job."""

    method: str  # "sbatch" or "requeue"
    script: Path | None = None  # the batch script to submit (None: ask scontrol for this job's)
    sbatch_args: tuple[str, ...] = ()
    exclude_scope: str = "node"  # "node": the node this driver runs on; "job": every node of the job
    timeout: float = 30.0

    @property
    def tool(self) -> str:
        return "sbatch" if self.method == "sbatch" else "scontrol"

    @property
    def flag(self) -> str:
        return "--submit" if self.method == "sbatch" else "--requeue"


def run_bounded(cmd: Sequence[str], *, env: Mapping[str, str], timeout: float,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm client command with a deadline, capturing its output; on timeout its whole process
    group is killed (a wrapper script's children included) and TimeoutExpired raised."""
    proc = subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def submit_env(env: Mapping[str, str]) -> dict[str, str]:
    """sbatch's environment: without this job's SLURM_* values (sbatch and the new job would take them
    as settings), keeping SLURM_CONF; the new job gets everything else (sbatch's default --export=ALL)."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def find_tool(name: str, env: Mapping[str, str], flag: str = "--submit/--requeue") -> str:
    path = shutil.which(name, path=env.get("PATH", os.defpath))
    if path is None:
        raise SlurmSetupError(f"`{name}` is not on PATH ({env.get('PATH', '')}): run where the Slurm client "
                              f"commands are installed, or drop {flag}")
    return path


def batch_script_of(job_id: str, env: Mapping[str, str], timeout: float, runner: Runner = run_bounded) -> Path:
    """The batch script this job was submitted with (scontrol's Command=), to submit it again."""
    scontrol = find_tool("scontrol", env)
    hint = "pass --sbatch-script"
    try:
        res = runner([scontrol, "show", "job", job_id], env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmSetupError(f"scontrol show job {job_id} did not answer within {timeout:.0f} s: {hint}") from None
    command = command_of_job(res.stdout) if res.returncode == 0 else None
    if not command:
        raise SlurmSetupError(f"cannot find the batch script of job {job_id} (submitted from stdin?): {hint}")
    path = Path(command)
    if not path.is_file() and Path(command.split()[0]).is_file():
        path = Path(command.split()[0])  # some Slurm versions append the script's arguments
    if not path.is_file():
        raise SlurmSetupError(f"the batch script of job {job_id}, {command}, is not readable here: {hint}")
    return path


def command_of_job(show_job: str | None) -> str | None:
    """The Command= field of `scontrol show job` output (None when absent or "(null)")."""
    match = re.search(r"^\s*Command=(.*)$", show_job or "", re.M)
    command = match.group(1).strip() if match else ""
    return command if command and command != "(null)" else None


def sbatch_command(sbatch: str, job_id: str, script: Path, excluded: Sequence[str],
                   extra: Sequence[str] = ()) -> list[str]:
    """`sbatch --parsable --dependency=afterany:JOB [--exclude=NODES] [EXTRA...] SCRIPT`."""
    cmd = [sbatch, "--parsable", f"--dependency=afterany:{job_id}"]
    if excluded:
        cmd.append(f"--exclude={','.join(excluded)}")
    return [*cmd, *extra, str(script)]


def parse_sbatch_job_id(stdout: str) -> str:
    """`--parsable` prints JOBID or JOBID;CLUSTER."""
    text = (stdout or "").strip()
    first = text.splitlines()[0] if text else ""
    job_id = first.split(";")[0].strip()
    if not job_id.isdigit():
        raise SubmitError(f"sbatch printed no job id (output: {first[:80]!r})")
    return job_id


def call(cmd: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Path | None = None,
         runner: Runner = run_bounded) -> str:
    """Run one Slurm command; its stdout, or SubmitError with the last line it printed."""
    name = Path(cmd[0]).name
    try:
        res = runner(list(cmd), env=env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{name} did not answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise SubmitError(f"cannot run {cmd[0]}: {exc.strerror}") from None
    if res.returncode != 0:
        why = (res.stderr or res.stdout or "").strip().splitlines()
        raise SubmitError(f"{name} failed (exit {res.returncode}): {why[-1] if why else 'no output'}")
    return res.stdout or ""


def exclude_from_pending(scontrol: str, job_id: str, excluded: Sequence[str], env: Mapping[str, str],
                         timeout: float, runner: Runner = run_bounded) -> bool:
    """After a requeue the job is pending (begin-time delay): keep it off the bad node(s)."""
    try:
        call([scontrol, "update", f"JobId={job_id}", f"ExcNodeList={','.join(excluded)}"], env, timeout,
             runner=runner)
        return True
    except SubmitError as exc:
        log.warning("requeued job %s, but could not exclude %s from it: %s", job_id, ",".join(excluded), exc)
        return False
