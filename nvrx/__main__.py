"""``python -m nvrx``: the command-line tool (the program's entry, above every package; run, not imported)."""

import runpy

runpy.run_module("nvrx.nvrx_cli.entry", run_name="__main__", alter_sys=True)
