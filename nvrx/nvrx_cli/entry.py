"""The ``nvrx`` console script and ``python -m nvrx``: the CLI behind an import guard.

The guard imports only the standard library first, so a missing or shadowed dependency (torch, click,
yaml, ...) becomes one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from nvrx.nvrx_cli.main import main
    except ImportError as err:
        from nvrx.common.imports import describe_import_error
        sys.stderr.write(f"nvrx: error: {describe_import_error(err)}\n")
        sys.exit(2)
    main()


if __name__ == "__main__":
    run()
