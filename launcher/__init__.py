"""`nvrx launch` and `nvrx resume`, one subpackage per role.

- ``launcher.agent``: the per-node agent process (config, rendezvous, rank start/stop, fork server,
  the rank monitors it owns).
- ``launcher.rank``: what runs inside a rank (the bootstrap, ``job_control``, in-process restart).
- ``launcher.resume``: the ``nvrx resume`` driver (decision, state file, progress, Slurm continuation).
"""
