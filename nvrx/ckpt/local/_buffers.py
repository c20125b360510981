"""Zero-copy byte views of CPU tensors, without numpy (torch may be built without it)."""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over the bytes of contiguous CPU tensor T (alive as long as T is)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """T's data as a flat uint8 tensor (a view when T is contiguous, else a contiguous copy first)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
