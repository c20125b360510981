"""`nvrx launch`: a drop-in for torchrun. Parses flags, builds the LaunchConfig, runs the agent."""

from __future__ import annotations

import logging
import os
import resource
import sys
import warnings
from typing import Any

import click

from nvrx.launcher.agent.config import (AGENT_FDS_PER_RANK, build_launch_config, check_hosts_resolve,
                                       empty_script_note)
from nvrx.nvrx_cli.ft_args import extract_ft_args
from nvrx.common.errors import ConfigError
from nvrx.common.files import UnsafeDirectoryError, owned_private_dir, private_dir
from nvrx.common.signals import DEFAULT_SIGNALS

# (option names, click kwargs). Underscore spellings are accepted as torchrun accepts them.
_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--nnodes",), dict(default=None, help="Number of nodes, or MIN:MAX for an elastic job [default: 1, or the "
                                           "nodes of the Slurm step].")),
    (("--nproc-per-node", "--nproc_per_node"), dict(default="1", show_default=True,
                                                    help="Ranks per node: a number, or cpu/auto.")),
    (("--node-rank", "--node_rank"), dict(default=None, help="Fixed rank of this node (needs a fixed --nnodes).")),
    (("--rdzv-endpoint", "--rdzv_endpoint"), dict(default=None, help="HOST[:PORT] of the rendezvous (default port 29400).")),
    (("--rdzv-id", "--rdzv_id"), dict(default=None, help="Job id; every node of a job must use the same one.")),
    (("--rdzv-backend", "--rdzv_backend"), dict(default="c10d", show_default=True,
                                                help="Accepted for torchrun compatibility (c10d/static); nvrx runs its own.")),
    (("--rdzv-conf", "--rdzv_conf"), dict(default=None, help="KEY=VALUE,... read: join_timeout, last_call_timeout, "
                                                             "keepalive_interval, keepalive_timeout, store_timeout "
                                                             "(seconds).")),
    (("--job-secret-file",), dict(default=None, help="Private file (mode 0600) with the secret that signs the "
                                                     "rendezvous records (env NVRX_JOB_SECRET_FILE; docs/security.md).")),
    (("--standalone",), dict(is_flag=True, help="Single node with a local rendezvous on a free port.")),
    (("--max-restarts", "--max_restarts"), dict(default="0", show_default=True,
                                                help="Job-wide number of restarts before giving up.")),
    (("--monitor-interval", "--monitor_interval"), dict(default="0.1", show_default=True,
                                                        help="Accepted for compatibility; nvrx waits on exits directly.")),
    (("--master-addr", "--master_addr"), dict(default=None, help="Process-group host (static style).")),
    (("--master-port", "--master_port"), dict(default=None, help="Fixed process-group port (default: a free port per round).")),
    (("--local-addr", "--local_addr"), dict(default=None, help="Address this node advertises to the others.")),
    (("--virtual-local-rank", "--virtual_local_rank"), dict(is_flag=True, help="Each rank gets LOCAL_RANK=0 and "
                                                            "only its own GPU in CUDA_VISIBLE_DEVICES (torchrun's).")),
    (("-m", "--module"), dict(is_flag=True, help="Run the script as a module, like python -m.")),
    (("--no-python", "--no_python"), dict(is_flag=True, help="Run the script as a program, not with python.")),
    (("--log-dir", "--log_dir"), dict(default=None, help="Directory for event logs and rank output files.")),
    (("--state-dir", "--state_dir"), dict(default=None, help="Where rank monitors keep learned timeouts across jobs "
                                         "(env NVRX_STATE_DIR; under nvrx resume $NVRX_RESUME_STATE_DIR/ft_state; "
                                         "default <log dir>/<run id>/ft_state).")),
    (("-r", "--redirects"), dict(default=None, help="Send rank streams to files: 0-3 or LOCAL_RANK:N,...")),
    (("-t", "--tee"), dict(default=None, help="Files and console, lines prefixed with the rank: 0-3 or LOCAL_RANK:N,...")),
    (("--local-ranks-filter", "--local_ranks_filter"), dict(default=None, help="Show only these local ranks on the console.")),
    (("--role",), dict(default="default", show_default=True, help="Role name given to ranks (ROLE_NAME).")),
    (("--term-timeout", "--term_timeout"), dict(default="30", show_default=True,
                                                help="Grace in seconds between SIGTERM and SIGKILL when stopping ranks.")),
    (("--signals-to-handle", "--signals_to_handle"), dict(default=DEFAULT_SIGNALS, show_default=True,
                                                          help="Signals the agent catches and forwards to ranks.")),
    (("--fork-server/--no-fork-server",), dict(default=True, show_default=True,
                                              help="Fork ranks from a process that imported torch once (fast restarts).")),
    (("--fast-exit/--no-fast-exit",), dict(default=True, show_default=True,
                                          help="Ranks end after atexit handlers and flushes, skipping interpreter teardown.")),
    (("--inprocess",), dict(is_flag=True, help="Restart a failed job inside the live ranks: the script runs in an "
                                               "in-process restart Wrapper (docs/guides/inprocess.md).")),
    (("--inprocess-spares",), dict(default="0", show_default=True, help="With --inprocess: ranks kept idle as spares, "
                                                                        "used when active ranks are lost.")),
    (("--async-ckpt",), dict(is_flag=True, help="Start each rank's persistent checkpoint writer process at rank start "
                                                "(used by ckpt.async_save; docs/guides/checkpoints.md).")),
    (("--jit-ckpt",), dict(is_flag=True, help="When a rank fails, ask the survivors to save their last completed "
                                              "step before they are stopped (PeriodicCheckpointer(save_on_failure="
                                              "True); docs/guides/checkpoints.md).")),
    (("--jit-ckpt-timeout",), dict(default=None, help="Seconds a just-in-time checkpoint may take before the restart "
                                                      "goes on without it (default 5).")),
    (("--local-ckpt-dir",), dict(default=None, help="Node-local directory for ckpt.local checkpoints, passed to ranks as "
                                                    "NVRX_LOCAL_CKPT_DIR (docs/guides/checkpoints.md).")),
    (("--fault-tol-cfg-path", "--ft-cfg-path"), dict(default=None, help="YAML with FaultToleranceConfig fields "
                                                                         "(a `fault_tolerance:` key or bare fields).")),
    (("--log-level",), dict(default="WARNING", show_default=True, help="Agent log level on stderr.")),
    (("-q", "--quiet"), dict(is_flag=True, help="Only the final status line on the terminal.")),
]


def value_flags() -> set[str]:
    """Our options that take a value: needed to find where the training script starts in argv."""
    out: set[str] = set()
    for names, kwargs in _OPTIONS:
        if not kwargs.get("is_flag") and "/" not in names[0]:
            out.update(names)
    return out


def split_ft_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Take the --ft-param-*/--ft-* flags out of the launcher's part of argv (before the script)."""
    return extract_ft_args(argv, value_flags=value_flags(), passthrough={"--ft-cfg-path", "--fault-tol-cfg-path"})


def _add_options(func: Any) -> Any:
    for names, kwargs in reversed(_OPTIONS):
        func = click.option(*names, **kwargs)(func)
    return func


@click.command(context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]})
@_add_options
@click.argument("training_script", required=False)
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(ctx: click.Context, **raw: Any) -> int:
    """Run TRAINING_SCRIPT on NPROC_PER_NODE ranks per node and keep the job going through faults.

    Fault-tolerance settings: --fault-tol-cfg-path FILE and --ft-param-<field> VALUE (docs/reference/config.md).
    """
    from nvrx.events import EventLog
    from nvrx.monitors.ft_config import inactive_settings_warning, load_ft_config
    from nvrx.nvrx_cli.status import StatusPrinter

    try:
        ft = load_ft_config(raw["fault_tol_cfg_path"], os.environ, (ctx.obj or {}).get("ft_overrides", {}))
        cfg = build_launch_config(raw, os.environ, ft=ft)
        check_hosts_resolve(cfg.rdzv)  # before the first round, which would retry a bad name until join_timeout
    except ConfigError as err:
        raise click.UsageError(str(err)) from None
    _setup_logging(raw["log_level"])
    log = logging.getLogger(__name__)
    for note in (inactive_settings_warning(ft), empty_script_note(cfg.workers)):
        if note:
            log.warning("%s", note)  # once, here: accepted, but not what the user may think it does
    _raise_fd_limit(cfg.workers.nproc_per_node)
    _make_run_dirs(cfg, raw)
    events = EventLog(cfg.run_log_dir / f"agent-{cfg.node_name}-{os.getpid()}.jsonl", source="agent")
    events.subscribe(StatusPrinter(quiet=raw["quiet"]))
    return _run_agent(cfg, events)


def _raise_fd_limit(nproc: int) -> None:
    """Lift the soft open-files limit towards the hard one when NPROC ranks need more descriptors than it allows
    (the config bounded NPROC by the hard limit); a soft limit of 1024 is common and too small for ~100 ranks."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = nproc * AGENT_FDS_PER_RANK + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            pass


def _make_run_dirs(cfg: Any, raw: dict[str, Any]) -> None:
    """Create the run's log directory (and the state dir) before anything starts, private (0700); a path that
    cannot be made is a usage error, one line, instead of a traceback from the first file written there."""
    dirs = [("--log-dir", cfg.run_log_dir)]
    if cfg.ft is not None and cfg.state_dir is not None:
        dirs.append(("--state-dir", cfg.state_dir))
    for flag, path in dirs:
        try:
            # the run's own directory: refused if nvrx did not make it for this user (planted links)
            (owned_private_dir if path == cfg.run_log_dir else private_dir)(path)
        except UnsafeDirectoryError as exc:
            raise click.UsageError(f"{flag}: {exc.strerror}; remove it or pass another {flag} or --rdzv-id") from None
        except OSError as exc:
            given = raw.get(flag[2:].replace("-", "_"))
            what = f"{flag} {given}" if given else f"the default {flag[2:].replace('-', ' ')} ({path.parent})"
            raise click.UsageError(f"{what}: cannot create {path} ({exc.strerror or exc}); "
                                   f"pass a {flag} you can write") from None


def _run_agent(cfg: Any, events: Any) -> int:
    """Run the agent and turn rendezvous problems into one line on stderr."""
    # The agent imports torch only for TCPStore, after it has started the fork server (so the two
    # imports overlap); torch's import-time notice about a missing numpy is noise on the agent's terminal.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from nvrx.common import exit_codes
    from nvrx.launcher.agent.agent import Agent
    from nvrx.launcher.agent.rdzv_errors import RendezvousError

    try:
        return Agent(cfg, events, sys.stdout.buffer, sys.stderr.buffer).run()
    except RendezvousError as err:
        click.echo(f"nvrx: error: {err}", err=True)
        return exit_codes.USAGE if err.usage else exit_codes.FAILED
    finally:
        events.close()


def _setup_logging(level: str) -> None:
    lvl = getattr(logging, str(level).upper(), None)
    if not isinstance(lvl, int):
        raise click.UsageError(f"--log-level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=lvl, stream=sys.stderr, format="nvrx %(levelname)s %(name)s: %(message)s")
