"""Errors raised by nvrx checkpointing: one line saying what is wrong and what to do about it."""

from __future__ import annotations

from nvrx.common.errors import NvrxError

class CheckpointError(NvrxError, RuntimeError):
    """A checkpoint could not be saved, finalized, found or verified."""


class CheckpointWriteError(CheckpointError):
    """Saving a checkpoint failed (staging, the writer process, or finalize); the message says what is intact."""


class CheckpointCleanupError(CheckpointWriteError):
    """The checkpoint was published and is complete, but moving ``latest`` or removing older ones failed.

    A subclass of ``CheckpointWriteError`` so loops that catch save failures catch it too; unlike them
    the new checkpoint exists and loads (the loader picks the newest complete checkpoint by itself).
    """
