"""Keep torch's C++ warnings off an agent's terminal.

A TCPStore client whose add() hits a value that is not an integer (a counter overwritten by another program)
loses its connection, and torch's C++ code logs it as a warning with a ~15-line C++ stack trace; the server side
logs one more line. The agent already turns such events into one line of its own (and repairs the counter), so
in the agent process torch's C++ log threshold is raised to errors, unless the user chose one with torch's own
TORCH_CPP_LOG_LEVEL. Only the agent: ranks keep torch's defaults (NCCL and gloo warnings are the user's).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping

log = logging.getLogger(__name__)

CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"  # torch reads it once, when libc10 is initialised
_ERROR = 2  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL


def quiet_cpp_warnings(env: Mapping[str, str]) -> bool:
    """Raise this process's c10 log threshold to ERROR (torch must be imported); False if ENV sets
    TORCH_CPP_LOG_LEVEL (the user's choice stands) or libc10's flag cannot be found."""
    if env.get(CPP_LOG_LEVEL_ENV):
        return False
    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level").value = _ERROR
    except (OSError, ValueError) as exc:  # another build of torch: its warnings stay, nothing else changes
        log.debug("cannot raise torch's C++ log level: %s", exc)
        return False
    return True
