"""NVRx's ``inprocess.exception`` module name: the Wrapper's exceptions (defined in ``exceptions``)."""

from nvrx.launcher.rank.inprocess.exceptions import (HealthCheckError, InternalError, RestartAbort, RestartError,
                                                RetriesExhausted, TimeoutError)

__all__ = ["HealthCheckError", "InternalError", "RestartAbort", "RestartError", "RetriesExhausted", "TimeoutError"]
