"""The `nvrx launch` agent: one process per node that rendezvouses, starts the ranks and restarts them."""
