"""Code that runs inside a rank: the bootstrap, ``job_control`` and the in-process restart ``inprocess``.

Nothing here imports the agent: a rank sees only its environment, its monitor and the job's store.
"""
