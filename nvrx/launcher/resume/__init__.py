"""`nvrx resume`: the auto-resume driver (decision, state file, progress, Slurm continuation)."""
