"""`nvrx resume`: the auto-resume driver. Parses flags and the Slurm environment into a ResumeConfig
and runs launcher.resume.driver.ResumeDriver; bash loops branch on its exit status (0 / 3 / 4)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Mapping

import click

from nvrx.common import exit_codes
from nvrx.common.errors import NvrxError
from nvrx.common.files import file_kind
from nvrx.launcher.rank.job_control import FINISHED_FLAG_ENV

_EPILOG = """\b
Modes:
  nvrx resume --state-dir D [LIMITS] -- [nvrx launch] LAUNCH_ARGS...
      run nvrx launch again until finished, out of budget, or stopped by a signal
  nvrx resume --state-dir D --exit-code RC [LIMITS]
      record a launch that already ran (bash loops) and decide
  nvrx resume --state-dir D --check
      only report: finished / continue / give up
  nvrx resume --state-dir D --stop
      end the chain on purpose: the pending continuation gives up (--reset undoes it)
  add --submit (sbatch a continuation after this job) or --requeue (scontrol requeue) to
  continue across jobs when the decision is "continue".
\b
Exit status: 0 finished, 3 continue, 4 give up, 2 usage error / unusable state dir,
1 the continuation could not be submitted.
"""


class ResumeFailure(NvrxError, click.ClickException):
    """A runtime problem the user must fix (state dir, Slurm tools): one line, exit 2."""

    exit_code = exit_codes.USAGE


@click.command(context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
               epilog=_EPILOG)
@click.option("--state-dir", required=True, type=click.Path(path_type=Path),
              help="Directory of this run's state (state.json, resume.jsonl); must exist and survive across jobs.")
@click.option("--max-attempts", type=click.IntRange(min=0), default=10, show_default=True,
              help="Launches in total, over all jobs (0 = no limit).")
@click.option("--max-failures", type=click.IntRange(min=0), default=3, show_default=True,
              help="Failed launches in total (interruptions are not failures; 0 = no limit).")
@click.option("--max-no-progress", type=click.IntRange(min=0), default=3, show_default=True,
              help="Consecutive launches whose iteration did not advance (needs a progress source; 0 = off).")
@click.option("--progress-file", type=click.Path(path_type=Path),
              help="File the training rewrites with its current iteration (an integer).")
@click.option("--checkpoint-dir", type=click.Path(path_type=Path),
              help="Checkpoint dir: latest_checkpointed_iteration.txt, or the newest iter_N / step-N entry.")
@click.option("--exit-code", "exit_code", type=click.IntRange(0, 255),
              help="Record the exit status of a launch that already ran instead of running one.")
@click.option("--check", is_flag=True, help="Only report the run's status; run and record nothing.")
@click.option("--stop", is_flag=True, help="End the chain on purpose: later attempts and continuations give up "
                                            "(e.g. after scancel; --reset undoes it).")
@click.option("--reset", is_flag=True, help="Start counting attempts and failures from zero (history is kept).")
@click.option("--submit", is_flag=True,
              help="On 'continue', sbatch the continuation: --dependency=afterany:$SLURM_JOB_ID [--exclude=...].")
@click.option("--requeue", is_flag=True, help="On 'continue', `scontrol requeue` this job instead of sbatch.")
@click.option("--sbatch-script", type=click.Path(path_type=Path),
              help="Script to submit (default: this job's batch script, from scontrol).")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="ARG",
              help="Extra argument for sbatch (repeatable), e.g. --sbatch-arg=--time=4:00:00.")
@click.option("--exclude-scope", type=click.Choice(["node", "job"]), default="node", show_default=True,
              help="After exit 16, exclude the node whose rank exited 16 (found in the agents' logs, see "
                   "--launch-log-dir) or every node of the job.")
@click.option("--launch-log-dir", type=click.Path(path_type=Path),
              help="Where the launches write their event logs (their --log-dir; default: the --log-dir in the "
                   "command after --, else ./nvrx_logs). After exit 16 the node to exclude is read from them.")
@click.option("--submit-timeout", type=click.FloatRange(min=1), default=30.0, show_default=True,
              help="Seconds to wait for sbatch/scontrol.")
@click.option("--job-id", default=None, help="This job's id (default: SLURM_JOB_ID).")
@click.option("--exec", "exec_command", is_flag=True,
              help="Run the command after -- as is (e.g. srun ... nvrx launch ...), not as nvrx launch arguments.")
@click.option("--log-level", default="INFO", show_default=True, help="Log level of the driver's lines on stderr.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def resume(ctx: click.Context, **raw: Any) -> int:
    """Run or record `nvrx launch` attempts of one run and decide: finished, continue, or give up.

    Ranks get FAULT_TOL_FINISHED_FLAG_FILE (default STATE_DIR/finished.flag); training calls
    launcher.rank.job_control.mark_finished() when it is complete, which ends the chain.
    """
    from nvrx.launcher.resume.driver import ResumeDriver, SubmitError
    from nvrx.launcher.resume.state import ResumeError

    explicit = {name for name in raw if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
    cfg = build_resume_config(raw, os.environ, explicit, Path.cwd())
    _setup_logging(raw["log_level"])
    try:
        return ResumeDriver(cfg).run()
    except ResumeError as err:
        raise ResumeFailure(str(err)) from None
    except SubmitError as err:
        click.echo(f"nvrx: error: could not submit the continuation: {err}", err=True)
        return exit_codes.FAILED


def build_resume_config(raw: dict[str, Any], environ: Mapping[str, str], explicit: set[str], cwd: Path) -> Any:
    """Flags + environment -> ResumeConfig (raises click.UsageError on contradictory flags)."""
    from nvrx.launcher.resume.driver import Limits, ProgressSource, ResumeConfig, SubmitSettings

    command = _launch_command(tuple(raw["command"]), raw["exec_command"])
    modes = [m for m, on in (("a command after --", bool(command)), ("--exit-code", raw["exit_code"] is not None),
                             ("--check", raw["check"]), ("--stop", raw["stop"])) if on]
    if not modes:
        raise click.UsageError("nothing to do: give the launch after -- (e.g. nvrx resume --state-dir D -- "
                               "--nproc-per-node 8 train.py), or --exit-code RC, or --check, or --stop")
    if len(modes) > 1:
        raise click.UsageError(f"{' and '.join(modes)} cannot be combined: pick one mode")
    if raw["submit"] and raw["requeue"]:
        raise click.UsageError("--submit and --requeue cannot be combined: sbatch a continuation or requeue this job")
    across = raw["submit"] or raw["requeue"]
    for name, flag_name in (("sbatch_script", "--sbatch-script"), ("sbatch_args", "--sbatch-arg")):
        if name in explicit and not raw["submit"]:
            raise click.UsageError(f"{flag_name} only applies with --submit")
    if raw["exec_command"] and command and shutil.which(command[0], path=environ.get("PATH", os.defpath)) is None:
        raise click.UsageError(f"--exec: {command[0]!r} is not on PATH")
    progress = ProgressSource(_progress_file(_abs(raw["progress_file"], cwd)), _abs(raw["checkpoint_dir"], cwd))
    if "max_no_progress" in explicit and raw["max_no_progress"] and not progress.tracked:
        raise click.UsageError("--max-no-progress needs a progress source: --progress-file FILE or --checkpoint-dir DIR")
    state_dir = _abs(raw["state_dir"], cwd)
    env = dict(environ)
    flag = Path(env.get(FINISHED_FLAG_ENV) or state_dir / "finished.flag")
    flag = _abs(flag, cwd)
    env[FINISHED_FLAG_ENV] = str(flag)
    env["NVRX_RESUME_STATE_DIR"] = str(state_dir)
    submit = None
    if across:
        submit = SubmitSettings(method="sbatch" if raw["submit"] else "requeue",
                                script=_abs(raw["sbatch_script"], cwd), sbatch_args=tuple(raw["sbatch_args"]),
                                exclude_scope=raw["exclude_scope"], timeout=raw["submit_timeout"])
    return ResumeConfig(
        state_dir=state_dir, finished_flag=flag, env=env, command=command, exit_code=raw["exit_code"],
        check_only=raw["check"], reset=raw["reset"], stop=raw["stop"],
        limits=Limits(raw["max_attempts"], raw["max_failures"], raw["max_no_progress"]),
        progress=progress, submit=submit, slurm=slurm_facts(environ, raw["job_id"]), cwd=cwd,
        launch_log_dir=_abs(raw.get("launch_log_dir") or _log_dir_of(command) or Path("nvrx_logs"), cwd))


def _progress_file(path: Path | None) -> Path | None:
    """--progress-file, which may not exist yet (the training writes it), but if it does, is a regular file: a fifo
    would block every read of it, a directory never holds an iteration."""
    if path is None:
        return None
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise click.UsageError(f"--progress-file {path}: {exc.strerror or exc}; give the file the training rewrites "
                               "with its iteration") from None
    if not stat.S_ISREG(mode):
        raise click.UsageError(f"--progress-file {path} is {file_kind(mode)}, not a regular file; give the file the "
                               "training rewrites with its iteration")
    return path


def _log_dir_of(command: tuple[str, ...]) -> Path | None:
    """The --log-dir given to nvrx launch in COMMAND: looked for after the `launch` word and before the
    training script (the first *.py), so that a --log-dir of the training script is not taken."""
    start = command.index("launch") + 1 if "launch" in command else 0
    for i, arg in enumerate(command[start:], start):
        if arg.endswith(".py"):
            return None
        for flag in ("--log-dir", "--log_dir"):
            if arg == flag and i + 1 < len(command):
                return Path(command[i + 1])
            if arg.startswith(flag + "="):
                return Path(arg[len(flag) + 1:])
    return None


def slurm_facts(environ: Mapping[str, str], job_id: str | None = None) -> Any:
    """The Slurm job this runs in, from Slurm's environment variables."""
    from nvrx.slurm.nodes import SlurmFacts

    nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    submit_dir = environ.get("SLURM_SUBMIT_DIR")
    return SlurmFacts(
        job_id=job_id or environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None,
        node_name=environ.get("SLURMD_NODENAME") or None,
        nodelist=environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or None,
        num_nodes=int(nodes) if nodes and nodes.isdigit() else None,
        restart_count=int(restarts) if restarts.isdigit() else 0,
        submit_dir=Path(submit_dir) if submit_dir else None,
    )


def _launch_command(args: tuple[str, ...], as_is: bool) -> tuple[str, ...]:
    """`nvrx launch ARGS` / `launch ARGS` / `ARGS` -> this interpreter running nvrx launch ARGS;
    with --exec the command is run as given."""
    if not args:
        return ()
    if as_is:
        return args
    if args[:2] == ("nvrx", "launch"):
        args = args[2:]
    elif args[:1] == ("launch",):
        args = args[1:]
    return (sys.executable, "-P", "-m", "nvrx", "launch", *args)


def _abs(path: Path | None, cwd: Path) -> Path | None:
    if path is None:
        return None
    path = Path(path).expanduser()
    return path if path.is_absolute() else cwd / path


def _setup_logging(level: str) -> None:
    lvl = getattr(logging, str(level).upper(), None)
    if not isinstance(lvl, int):
        raise click.UsageError(f"--log-level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("nvrx resume: %(message)s"))
    for name in ("nvrx.resume", "nvrx.launcher.resume.state"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(lvl)
        logger.propagate = False
