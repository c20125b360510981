"""``TensorAwareStateDict``: a state dict that can be split into a hollow structure and its tensors, and back.

The split is what makes local checkpoints cheap to move: the tensors travel as one flat buffer (to a file,
or to the ranks holding replicas) and the hollow structure as a little JSON; nothing is pickled.
Names and signatures follow NVRx's ``nvidia_resiliency_ext.checkpointing.local.base_state_dict``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Sequence

import torch


class TensorAwareStateDict(ABC):
    """The interface between a user's state dict and the ``LocalCheckpointManager``."""

    @abstractmethod
    def pop_tensors(self) -> Sequence[torch.Tensor]:
        """Take the tensors out, leaving placeholders (the dict becomes hollow); returns them in a fixed order."""

    @property
    @abstractmethod
    def tensors(self) -> Sequence[torch.Tensor]:
        """The tensors, in the order ``pop_tensors`` returns them (the dict must not be hollow)."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True after ``pop_tensors`` until ``insert_tensors`` / ``init_tensors``."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Reverse of ``pop_tensors``: put TENSOR_DATA back in place of the placeholders, in order."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Fill the placeholders with empty tensors of the popped tensors' shape, dtype and device (receive buffers)."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace device tensors by CPU copies (originals untouched), remembering devices for ``restore_tensor_device``."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move tensors back to the devices remembered by ``copy_tensors_to_cpu`` (or recorded in a loaded file)."""

    @abstractmethod
    def values(self) -> Iterable[Any]:
        """The top-level values of the state dict, like ``dict.values()``."""
