"""Errors raised by nvrx checkpointing: one line saying what is wrong and what to do about it."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, finalized, found or verified."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (in the writer process or while publishing it); the previous one is intact."""
