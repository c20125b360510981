"""The per-node agent and everything it runs: config, rendezvous, workers, fork server, bootstrap."""
