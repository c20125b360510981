"""The exceptions of the in-process restart Wrapper.

``RestartInterrupt`` is what the Wrapper raises inside the wrapped function to stop it; it derives
from ``BaseException`` so that ``except Exception`` in user code does not stop it. Everything else
here is raised by the Wrapper itself and ends the Wrapper on the rank that raises it.
"""

from __future__ import annotations

import builtins
import sys
import types

from nvrx.common.errors import NvrxError


# Not an NvrxError, on purpose: it must pass through ``except Exception`` in the user's function.
class RestartInterrupt(BaseException):
    """Raised asynchronously in the wrapped function: a fault happened (here or on another rank).

    The wrapped function must let it propagate. The last instance is remembered (with the frame it
    was raised in) so the Wrapper can report where a function swallowed it.
    """

    last: "RestartInterrupt | None" = None

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        frame = sys._getframe(1)
        self.raised_in: tuple[str, int, str] | None = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        RestartInterrupt.last = self


def swallow_location(exc: RestartInterrupt) -> str:
    """Where a swallowed interrupt was raised and which frame caught it, as ``file:line (function)``."""
    tb: types.TracebackType | None = exc.__traceback__
    raised = exc.raised_in
    where = f"raised at {raised[0]}:{raised[1]} ({raised[2]})" if raised else "raised at an unknown place"
    if tb is None:
        return where + ", suppressed before it left that frame"
    code = tb.tb_frame.f_code
    return f"{where}, suppressed in {code.co_filename}:{tb.tb_frame.f_lineno} ({code.co_name})"


class InprocessError(NvrxError):
    """Base class of the errors the Wrapper raises itself; the message is one line saying what to do."""


class ConfigurationError(InprocessError, ValueError):
    """A Wrapper argument or the environment it reads is invalid."""


class ArgumentTypeError(ConfigurationError, TypeError):
    """A Wrapper or component argument of the wrong type: a ``TypeError`` as in NVRx, and a ``ValueError``
    (``ConfigurationError``) as every other bad argument of ours."""


class StoreUnavailable(InprocessError):
    """The Wrapper's distributed store cannot be reached (its host, rank 0 by default, is gone)."""


class RestartError(InprocessError):
    """Base of the errors raised by the Wrapper's components (NVRx's ``exception.RestartError``)."""


class HealthCheckError(RestartError):
    """This rank is not healthy enough to take part in another iteration (a health check's own exception is
    its ``__cause__``)."""


class InternalError(RestartError):
    """The Wrapper itself went wrong (a bug, not a fault of the job)."""


class TimeoutError(RestartError, builtins.TimeoutError):  # noqa: A001 - NVRx's name; still a builtin TimeoutError
    """A component did not finish in time (``ThreadedFinalize``, ``CudaHealthCheck``)."""


class RankTerminated(InprocessError):
    """This rank was removed from the job (timed out, excluded by rank assignment, or too late)."""


# Not an NvrxError, on purpose: raised from an ``initialize`` component inside the restart loop, it must not
# be taken for a fault of the iteration (the loop restarts on ``Exception``s) but end the Wrapper.
class RetriesExhausted(BaseException):
    """Raised by ``RetryController``: stop restarting. A BaseException so that it ends the Wrapper."""


# NVRx's name for the terminal "stop restarting" exception: the same class, so ``except RestartAbort`` catches
# what RetryController raises and a user's own ``raise RestartAbort(...)`` ends the Wrapper the same way.
RestartAbort = RetriesExhausted
