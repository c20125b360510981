"""Copy a state dict into one staging buffer, keeping its structure: the only part of a save training waits for.

A periodic save must not hold the training loop for planning, collectives or serialization: only the copy of
the values has to happen before the next optimizer step may change them. ``capture`` does that copy into a
reused staging buffer and returns the same nested structure with the tensors replaced by views of the buffer
(non-tensor values deep-copied). Saving that snapshot later, on another thread, writes exactly what the state
held at the capture: the writer takes the views' bytes where they already lie (``FileSystemWriterAsync``
notices a tensor inside its staging buffer), so nothing is copied twice.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from nvrx.ckpt.async_ckpt.staging import StagingBuffer, StagingPool, align, default_pool

_BYTES_SLACK = 4096  # per non-tensor value: room for its serialized bytes behind the tensors


@dataclass
class Snapshot:
    """STATE (the captured structure, tensors are views of BUFFER) and where the tensors end in BUFFER.

    PENDING: (source, view) pairs left for ``finish_copy`` (``capture``'s DEFER): until it ran, those views do
    not hold their values yet.
    """

    state: dict[str, Any]
    buffer: StagingBuffer
    used: int
    pool: StagingPool
    pending: list[tuple[Any, Any]] = field(default_factory=list)

    def finish_copy(self) -> None:
        """Copy the deferred tensors (any thread: the copy releases the GIL)."""
        import torch

        pending, self.pending = self.pending, []
        with torch.no_grad():  # (a view standing for a parameter requires grad, as the parameter does)
            for source, view in pending:
                view.copy_(source.detach())

    def release(self) -> None:
        """Give the buffer back (a save that used it releases it itself)."""
        self.pool.release(self.buffer)


def _plain(t: Any) -> bool:
    """A tensor whose bytes can be viewed flat (not a DTensor, sharded or other subclass)."""
    import torch

    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def capturable(obj: Any) -> bool:
    """True if every tensor in OBJ is a plain tensor (subclasses take the ordinary save path)."""
    import torch

    if isinstance(obj, dict):
        return all(capturable(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(capturable(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return _plain(obj)
    return True


def _layout(obj: Any, sizes: list[int]) -> tuple[int, int]:
    """Append each tensor's byte size to SIZES (traversal order); returns (tensor bytes, non-tensor values)."""
    import torch

    if isinstance(obj, dict):
        parts = [_layout(v, sizes) for v in obj.values()]
    elif isinstance(obj, (list, tuple)):
        parts = [_layout(v, sizes) for v in obj]
    elif isinstance(obj, torch.Tensor):
        sizes.append(obj.numel() * obj.element_size())
        return align(sizes[-1]), 0
    else:
        return 0, 1
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def capture(state: dict[str, Any], pool: StagingPool | None = None,
            defer: Callable[[Any], bool] | None = None) -> Snapshot:
    """Copy STATE's tensors into one staging buffer of POOL; returns the snapshot (tensors as views of it).

    DEFER(tensor) True: do not copy that tensor now, leave it to ``Snapshot.finish_copy`` (the caller keeps
    it unchanged until then).
    """
    pool = pool or default_pool()
    sizes: list[int] = []
    tensor_bytes, values = _layout(state, sizes)
    buffer = pool.acquire(tensor_bytes + values * _BYTES_SLACK, populate=False)  # (a new one: fill() allocates it)
    pending: list[tuple[Any, Any]] = []
    copies: list[tuple[int, Any, Any]] = []
    try:
        offset = [0]
        captured = _copy(state, buffer, offset, defer, pending, copies)
        if buffer.populated:  # warm: straight through the mapping
            for _, source, view in copies:
                view.detach().copy_(source)
        else:  # a new buffer: its pages are allocated as they are filled, by several threads
            buffer.fill([(start, source) for start, source, _ in copies])
    except BaseException:
        pool.release(buffer)
        raise
    return Snapshot(captured, buffer, offset[0], pool, pending)


def _copy(obj: Any, buffer: StagingBuffer, offset: list[int], defer: Callable[[Any], bool] | None,
          pending: list[tuple[Any, Any]], copies: list[tuple[int, Any, Any]]) -> Any:
    """OBJ's structure with each tensor a view of BUFFER; the copies to make now go to COPIES (offset, source, view)."""
    import torch

    if isinstance(obj, dict):
        return {k: _copy(v, buffer, offset, defer, pending, copies) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v, buffer, offset, defer, pending, copies) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy(v, buffer, offset, defer, pending, copies) for v in obj)
    if isinstance(obj, torch.Tensor):
        start = offset[0]
        nbytes = obj.numel() * obj.element_size()
        offset[0] = align(start + nbytes)
        view = buffer.bytes_view()[start: start + nbytes].view(obj.dtype).view(obj.shape)
        if defer is not None and nbytes and defer(obj):
            pending.append((obj, view))
        elif nbytes:
            copies.append((start, obj.detach(), view))
        if obj.requires_grad:  # the saved properties stay those of the original
            view.requires_grad_(True)
        return view
    return copy.deepcopy(obj)
