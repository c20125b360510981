"""Built-in rejection functions and the default comparison of two results.

``is_nan_or_inf`` rejects a non-finite result; ``SpikeDetector`` rejects a result larger than FACTOR times
the largest of the recent accepted results (a loss spike). Both are plain callables: pass them as
``rejection_func`` to ``RerunStateMachine.validate_result``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch


def as_float(result: Any) -> float:
    """RESULT (a Python number or a one-element tensor) as a float; TypeError/ValueError otherwise."""
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise ValueError(f"a tensor of shape {list(result.shape)}")
        return float(result.detach().item())
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise TypeError(f"a {type(result).__name__}")
    return float(result)


def is_nan_or_inf(result: Any) -> bool:
    """Reject a NaN or infinite result (a loss, a gradient norm)."""
    if isinstance(result, torch.Tensor):
        if result.numel() == 1:  # the usual case (a loss): item() is several times cheaper than isfinite().all()
            return not math.isfinite(result.item())
        return not bool(torch.isfinite(result).all())
    return not math.isfinite(result)


class SpikeDetector:
    """Reject a result above FACTOR x the running max of the last WINDOW accepted ones (after MIN_SAMPLES).

    Non-finite values are neither rejected nor remembered (``is_nan_or_inf`` is the check for them).
    Its memory goes into the machine's checkpoint when the machine owns it
    (``RerunStateMachine.is_unexpectedly_large``); ``state_dict``/``load_state_dict`` for one of your own.
    """

    def __init__(self, factor: float = 10.0, window: int = 100, min_samples: int = 10) -> None:
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
            raise ValueError(f"SpikeDetector factor must be a finite number > 1, not {factor!r}")
        if not (isinstance(window, int) and window >= 1 and isinstance(min_samples, int) and 1 <= min_samples):
            raise ValueError(f"SpikeDetector window and min_samples must be integers >= 1, not {window!r}, "
                             f"{min_samples!r}")
        self.factor = float(factor)
        self.min_samples = min(min_samples, window)
        self.recent: deque[float] = deque(maxlen=window)

    def __call__(self, result: Any) -> bool:
        value = abs(as_float(result))
        if not math.isfinite(value):
            return False
        if len(self.recent) >= self.min_samples and value > self.factor * max(self.recent):
            return True
        self.recent.append(value)
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "window": self.recent.maxlen, "min_samples": self.min_samples,
                "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.factor, self.min_samples = float(state["factor"]), int(state["min_samples"])
        self.recent = deque((float(x) for x in state["recent"]), maxlen=int(state["window"]))


def relative_difference(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude; 0 when both are the same non-finite value (NaN too)."""
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if math.isinf(a) or math.isinf(b):
        return 0.0 if a == b else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def shown(value: float | None) -> str | None:
    """A result as the event logs and the resume state carry it (JSON has no NaN): repr of the float."""
    return None if value is None else repr(float(value))


def parsed(text: str | None) -> float | None:
    """The float shown() wrote."""
    return None if text is None else float(text)
