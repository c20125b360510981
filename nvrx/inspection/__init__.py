"""The `nvrx inspect` backend: find a run's event files, fold them into a timeline, derive the report.

Rendering (rich, plain text, JSON) is the CLI's job (``nvrx/nvrx_cli/inspect_cmd.py``).
"""
