"""`nvrx launch` and `nvrx resume`, one subpackage per role.

- ``nvrx.launcher.agent``: the per-node agent process (config, rendezvous, rank start/stop, fork server,
  the rank monitors it owns).
- ``nvrx.launcher.rank``: what runs inside a rank (the bootstrap, ``job_control``, in-process restart).
- ``nvrx.launcher.resume``: the ``nvrx resume`` driver (decision, state file, progress, Slurm continuation).
"""
