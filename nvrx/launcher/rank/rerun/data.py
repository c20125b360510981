"""``RerunDataIterator``: a data iterator that can hand out one step's batches a second time.

The machine marks the start of every step (``advance``); the iterator keeps references to the batches
the step draws, and ``rewind`` makes the next draws replay exactly those objects, so a re-run in place
sees bitwise the same input without re-reading anything (do not modify a batch in place). A loader that
draws from the global random generators (random augmentation, ``torch.randn`` in a generator) moved them
in the first run; the iterator records the generators after each draw and a replay puts them there, so
the rest of the step draws the same numbers as the first time (``track_rng=False`` skips that).
Across a job boundary the batches are not saved: the resumed job's own data loader must start at the
step (as any resume from that checkpoint does), and the machine checks it with a fingerprint of the
step's batches (``fingerprint``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from nvrx.launcher.rank.rerun import rng


class RerunDataIterator:
    """Wraps ITERABLE for ``RerunStateMachine.should_run_forward_backward(data_iterator)``.

    ``position`` counts the batches handed out since the start (re-played ones not counted twice);
    ``state_dict()`` gives the position of the current step's start.
    """

    def __init__(self, iterable: Iterable[Any], position: int = 0, track_rng: bool = True) -> None:
        self.iterable = iterable
        self.track_rng = track_rng
        self._it: Iterator[Any] = iter(iterable)
        self._step: list[tuple[Any, rng.RngState | None]] = []  # this step's batches (+ the RNG after each)
        self._replay: list[tuple[Any, rng.RngState | None]] = []  # rewind()'s, handed out first (reversed)
        self.position = position        # batches drawn from the wrapped iterator so far
        self.step_start = position

    def __iter__(self) -> "RerunDataIterator":
        return self

    def __next__(self) -> Any:
        if self._replay:
            item, after = self._replay.pop()
            if after is not None:
                rng.restore(after)
            return item
        item = next(self._it)
        self._step.append((item, rng.capture() if self.track_rng else None))
        self.position += 1
        return item

    def advance(self) -> None:
        """A new step starts: forget the last step's batches."""
        self._step = []
        self._replay = []
        self.step_start = self.position

    def rewind(self) -> None:
        """The step runs again: hand out its batches again, in the same order."""
        self._replay = list(reversed(self._step))

    def step_batches(self) -> list[Any]:
        """The batches this step has drawn so far."""
        return [item for item, _ in self._step]

    def state_dict(self) -> dict[str, int]:
        """Where the current step started (what a checkpoint taken for a re-run records)."""
        return {"position": self.step_start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the position of a checkpoint; the wrapped iterator must already be positioned there."""
        self.position = self.step_start = int(state["position"])
        self._step, self._replay = [], []


def fingerprint(batches: list[Any]) -> int:
    """A CRC-32 of the batches' contents (tensors by their bytes, containers recursively).

    Computed only for a step under suspicion (never per healthy step): it proves that the job re-running
    that step from the checkpoint fed it the same data.
    """
    crc = 0
    for b in batches:
        crc = _crc(b, crc)
    return crc


def _crc(obj: Any, crc: int) -> int:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        crc = zlib.crc32(f"{t.dtype}{list(t.shape)}".encode(), crc)
        return zlib.crc32(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", crc)
    if isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            crc = _crc(obj[k], zlib.crc32(str(k).encode(), crc))
        return crc
    if isinstance(obj, (list, tuple)):
        for x in obj:
            crc = _crc(x, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)
