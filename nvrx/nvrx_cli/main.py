"""The `nvrx` click group and the error boundary: one clear line per user error, no traceback."""

from __future__ import annotations

import logging
import os
import sys

import click

from nvrx.common.errors import ConfigError
from nvrx.nvrx_cli.inspect_cmd import inspect
from nvrx.nvrx_cli.launch_cmd import launch, split_ft_args
from nvrx.nvrx_cli.resume_cmd import resume


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nvrx", prog_name="nvrx")
def cli() -> None:
    """nvrx: launch and supervise PyTorch training jobs through crashes, hangs and preemptions."""


cli.add_command(launch)
cli.add_command(inspect)
cli.add_command(resume)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: map click usage errors to a single line and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    obj: dict = {}
    try:
        if argv[:1] == ["launch"]:
            obj["ft_overrides"], rest = split_ft_args(argv[1:])
            argv = ["launch", *rest]
        rv = cli.main(args=argv, prog_name="nvrx", standalone_mode=False, obj=obj)
    except ConfigError as err:
        click.echo(f"nvrx: error: {err} (see 'nvrx launch --help')", err=True)
        _exit_now(2)
    except click.UsageError as err:
        where = f"nvrx {err.ctx.info_name} --help" if err.ctx and err.ctx.parent else "nvrx --help"
        msg = err.format_message().replace("\n", " ")
        click.echo(f"nvrx: error: {msg} (see '{where}')", err=True)
        sys.exit(2)
    except click.ClickException as err:
        click.echo(f"nvrx: error: {err.format_message()}", err=True)
        sys.exit(err.exit_code)
    except click.Abort:
        click.echo("nvrx: aborted", err=True)
        sys.exit(130)
    _exit_now(rv if isinstance(rv, int) else 0)


def _exit_now(code: int) -> None:
    """Leave without interpreter teardown: the agent has closed everything it owns, and tearing down
    an interpreter that imported torch costs ~0.4 s of pure shutdown latency."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
