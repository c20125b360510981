"""``BasicTensorAwareStateDict``: nested dicts and lists of tensors (CPU or CUDA) and plain values.

Tensors may sit only in dicts and lists (not tuples or objects), so walking the structure in a fixed order
finds every one of them and the same walk puts them back. The placeholder left for a popped tensor keeps its
dtype, shape and device: enough to allocate a receive buffer and to describe the tensor in a file header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from nvrx.ckpt.local.base_state_dict import TensorAwareStateDict
from nvrx.ckpt.local.errors import LocalCheckpointError


@dataclass(frozen=True)
class TensorPlaceholder:
    """Where a popped tensor was: its position in the walk order, dtype, shape and device."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str

    @classmethod
    def of(cls, index: int, t: torch.Tensor, device: str | None = None) -> "TensorPlaceholder":
        return cls(index, t.dtype, tuple(t.shape), device or str(t.device))


def _children(node: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(node, dict):
        yield from list(node.items())
    elif isinstance(node, list):
        yield from enumerate(list(node))


def walk_replace(node: Any, fn: Callable[[Any], Any], want: Callable[[Any], bool]) -> None:
    """Replace, in place and in walk order (dict insertion order, list order, depth first), each leaf
    for which WANT is true by FN(leaf)."""
    for key, value in _children(node):
        if want(value):
            node[key] = fn(value)
        elif isinstance(value, (dict, list)):
            walk_replace(value, fn, want)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _is_placeholder(x: Any) -> bool:
    return isinstance(x, TensorPlaceholder)


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """A plain (nested dict/list) state dict seen as hollow structure + tensors. Mutates STATE_DICT in place."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise LocalCheckpointError(f"a local checkpoint holds a dict, got {type(state_dict).__name__}; "
                                       "wrap your state in a dict")
        self.state_dict = state_dict
        self._hollow = False
        self._devices: list[str] | None = None

    def to_state_dict(self) -> dict[str, Any]:
        """The underlying (nested) dict; must not be hollow."""
        self._require_full("to_state_dict")
        return self.state_dict

    def _require_full(self, what: str) -> None:
        if self._hollow:
            raise LocalCheckpointError(f"{what}: the state dict is hollow; insert_tensors() or init_tensors() first")

    def _collect(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        walk_replace(self.state_dict, lambda t: found.append(t) or t, _is_tensor)
        return found

    def pop_tensors(self) -> list[torch.Tensor]:
        self._require_full("pop_tensors")
        popped: list[torch.Tensor] = []

        def take(t: torch.Tensor) -> TensorPlaceholder:
            device = self._devices[len(popped)] if self._devices else None
            popped.append(t)
            return TensorPlaceholder.of(len(popped) - 1, t, device)

        walk_replace(self.state_dict, take, _is_tensor)
        self._hollow = True
        return popped

    @property
    def tensors(self) -> list[torch.Tensor]:
        self._require_full("tensors")
        return self._collect()

    @property
    def is_hollow(self) -> bool:
        return self._hollow

    def placeholders(self) -> list[TensorPlaceholder]:
        """The placeholders of a hollow dict, in walk order."""
        found: list[TensorPlaceholder] = []
        walk_replace(self.state_dict, lambda p: found.append(p) or p, _is_placeholder)
        return found

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        if not self._hollow:
            raise LocalCheckpointError("insert_tensors: the state dict is not hollow; pop_tensors() first")
        data = list(tensor_data)
        holes = self.placeholders()
        if len(data) != len(holes):
            raise LocalCheckpointError(f"insert_tensors: {len(data)} tensors for {len(holes)} placeholders")
        walk_replace(self.state_dict, lambda p: data[p.index], _is_placeholder)
        self._hollow = False

    def init_tensors(self) -> None:
        self.insert_tensors(torch.empty(p.shape, dtype=p.dtype, device=_usable_device(p.device))
                            for p in self.placeholders())

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._require_full("copy_tensors_to_cpu")
        self._devices = [str(t.device) for t in self._collect()]
        walk_replace(self.state_dict, lambda t: t if t.device.type == "cpu" else t.to("cpu", non_blocking=non_blocking),
                     _is_tensor)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        self._require_full("restore_tensor_device")
        if not self._devices:
            return
        devices = iter(self._devices)
        walk_replace(self.state_dict, lambda t: _to_device(t, next(devices), non_blocking), _is_tensor)
        self._devices = None

    def remember_devices(self, devices: Sequence[str]) -> None:
        """Record the devices the tensors came from (a loaded checkpoint: they are on CPU now)."""
        self._devices = list(devices)

    def values(self) -> Iterable[Any]:
        return self.state_dict.values()


def _usable_device(device: str) -> str:
    """DEVICE, or a clear error when it is CUDA and this process has no CUDA."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LocalCheckpointError(f"the checkpoint has tensors on {device} but CUDA is not available here; "
                                   "load on a GPU node, or keep the tensors on CPU (skip restore_tensor_device)")
    return device


def _to_device(t: torch.Tensor, device: str, non_blocking: bool) -> torch.Tensor:
    if str(t.device) == device:
        return t
    return t.to(_usable_device(device), non_blocking=non_blocking)
