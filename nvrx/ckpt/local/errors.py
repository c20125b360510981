"""Errors of the local checkpoint tier: one line saying what is wrong and what to do about it."""

from __future__ import annotations

from nvrx.ckpt.errors import CheckpointError


class LocalCheckpointError(CheckpointError):
    """A local checkpoint could not be saved, found or restored."""


class LocalCheckpointCorruptError(LocalCheckpointError):
    """A local checkpoint file failed its checks (magic, header or payload CRC-32, size): use another copy."""


class NoReplicasAvailableError(LocalCheckpointError):
    """No rank holds a copy (own file or replica) of a shard some rank needs; restore from the global tier."""
