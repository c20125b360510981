"""Capture and restore every random number generator a step may draw from, so a re-run repeats it.

Python's ``random``, torch's CPU generator, NumPy's global generator (when NumPy is importable) and, when
CUDA is present, every CUDA device's generator. The state also travels in the re-run checkpoint as JSON
(``to_json``/``from_json``), so the next job re-runs the step from the very same random numbers.

CUDA sits behind ``cuda_states``/``set_cuda_states`` (one seam): on a machine without CUDA they report
nothing and do nothing, so the CPU path is the real one and the CUDA path is the same code with devices.
"""

from __future__ import annotations

import array
import base64
import random
from dataclasses import dataclass
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    np = None


def cuda_states() -> list[torch.Tensor] | None:
    """Every CUDA device's generator state, or None without CUDA (the seam for CPU-only machines)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_rng_state_all()


def set_cuda_states(states: list[torch.Tensor] | None) -> None:
    """Restore what cuda_states() returned (nothing to do without CUDA or without a saved state)."""
    if states is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states)


@dataclass(frozen=True)
class RngState:
    """The generators' states at one moment (the start of a step)."""

    python: tuple
    torch_cpu: torch.Tensor
    numpy: tuple | None
    cuda: list[torch.Tensor] | None


def capture() -> RngState:
    """The generators' states now; cheap (a few KiB copied), taken at the start of every validated step."""
    return RngState(python=random.getstate(), torch_cpu=torch.get_rng_state(),
                    numpy=np.random.get_state() if np is not None else None, cuda=cuda_states())


def restore(state: RngState) -> None:
    """Put every generator back where capture() found it."""
    random.setstate(state.python)
    torch.set_rng_state(state.torch_cpu)
    if state.numpy is not None and np is not None:
        np.random.set_state(state.numpy)
    set_cuda_states(state.cuda)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _words(values: Any) -> str:
    """32-bit words (a Mersenne Twister's state) as base64: a quarter of the size of a JSON list."""
    return base64.b64encode(array.array("I", (int(v) for v in values)).tobytes()).decode("ascii")


def _unwords(text: str) -> list[int]:
    words = array.array("I")
    words.frombytes(base64.b64decode(text))
    return words.tolist()


def to_json(state: RngState) -> dict[str, Any]:
    """STATE as plain JSON values (for the checkpoint: no pickle); about 14 KB."""
    version, internal, gauss = state.python
    out: dict[str, Any] = {"python": [version, _words(internal), gauss], "torch_cpu": _b64(state.torch_cpu)}
    if state.numpy is not None:
        name, keys, pos, has_gauss, cached = state.numpy
        out["numpy"] = [name, _words(keys), int(pos), int(has_gauss), float(cached)]
    if state.cuda is not None:
        out["cuda"] = [_b64(t.cpu()) for t in state.cuda]
    return out


def from_json(data: dict[str, Any]) -> RngState:
    """The RngState to_json() wrote; ValueError/KeyError/TypeError if DATA is not one."""
    version, internal, gauss = data["python"]
    npstate = None
    if data.get("numpy") is not None and np is not None:
        name, keys, pos, has_gauss, cached = data["numpy"]
        npstate = (name, np.array(_unwords(keys), dtype=np.uint32), pos, has_gauss, cached)
    cuda = [_tensor(s) for s in data["cuda"]] if data.get("cuda") is not None else None
    return RngState(python=(int(version), tuple(_unwords(internal)), gauss),
                    torch_cpu=_tensor(data["torch_cpu"]), numpy=npstate, cuda=cuda)
