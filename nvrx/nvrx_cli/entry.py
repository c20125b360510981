"""The ``nvrx`` console script and ``python -m nvrx``: the CLI behind an import guard.

The guard imports only the standard library first, so a missing or shadowed dependency (torch, click,
yaml, ...) becomes one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import sys


def _fail(line: str) -> None:
    sys.stderr.write(f"nvrx: error: {line}\n")
    sys.exit(2)


def run() -> None:
    from nvrx.common.imports import describe_import_error, shadowed_dependency

    shadow = shadowed_dependency()
    if shadow is not None:
        _fail(shadow)
    try:
        from nvrx.nvrx_cli.main import main
    except ImportError as err:
        _fail(describe_import_error(err))
    except Exception:
        shadow = shadowed_dependency()  # e.g. an empty click.py: the import works, its use does not
        if shadow is None:
            raise
        _fail(shadow)
    try:
        main()
    except ImportError as err:  # a dependency imported on first use (torch)
        _fail(describe_import_error(err))
    except Exception:
        shadow = shadowed_dependency()
        if shadow is None:
            raise  # a bug of ours: the traceback is what a report needs
        _fail(shadow)


if __name__ == "__main__":
    run()
