"""Checkpoint managers of the local tier (spec 002: ``ckpt_managers.local_manager.LocalCheckpointManager``)."""
