"""``nvrx launch --inprocess``: run the rank's script inside a ``Wrapper``.

The agent sets ``NVRX_INPROCESS=1`` (and ``NVRX_INPROCESS_SPARES=N`` for ``--inprocess-spares``) in each
rank's environment; the bootstrap then runs the script through :func:`run`. Every iteration executes
the script afresh as ``__main__`` in the same process (``import torch`` and other imports stay loaded).
A script that reaches its end, or calls ``sys.exit(0)``, has completed; another exit status is a fault
(restarted in place), except the steering codes (16, 17, 93), which end the job as without
``--inprocess``.

The script may also use ``Wrapper`` itself. Its settings are then honoured: when the script calls the
function it wrapped, that Wrapper runs a complete session of its own (its components, timeouts and
restarts) while this one stands aside, and an error that ends it ends the rank (the script is not
re-run over the user's decision). This Wrapper still restarts the script for faults outside that
function. ``--inprocess-spares`` spares are not lent to the script's Wrapper (give it a rank_filter).
"""

from __future__ import annotations

import sys
from typing import Callable, Mapping

from nvrx.common.exit_codes import FAILED, OK, STEERING_CODES
from nvrx.common.errors import NvrxError
from nvrx.launcher.rank.inprocess.exceptions import InprocessError, RetriesExhausted
from nvrx.launcher.rank.inprocess.rank_filter import MaxActiveWorldSize
from nvrx.launcher.rank.inprocess.wrapper import Wrapper

ENABLE_ENV = "NVRX_INPROCESS"
SPARES_ENV = "NVRX_INPROCESS_SPARES"


class ScriptFailed(NvrxError):
    """The script exited with a non-zero status: a fault, restarted in place."""


def enabled(env: Mapping[str, str]) -> bool:
    return env.get(ENABLE_ENV) == "1"


def build_wrapper(env: Mapping[str, str]) -> Wrapper:
    """The Wrapper for a launched script: defaults, plus spares from --inprocess-spares.

    It yields to a Wrapper the script applies itself (see ``RestartSession.defer``).
    """
    spares = int(env.get(SPARES_ENV) or 0)
    if spares <= 0:
        wrapper = Wrapper()
    else:
        world = int(env.get("WORLD_SIZE") or 1)
        wrapper = Wrapper(rank_filter=MaxActiveWorldSize(max(1, world - spares)))
    wrapper._yields_to_script_wrapper = True
    return wrapper


def _as_completion(run: Callable[[], None]) -> Callable[[], None]:
    def script() -> None:
        try:
            run()
        except SystemExit as exc:
            code = exc.code
            if code is None or code == 0:
                return
            if isinstance(code, int) and code in STEERING_CODES:
                raise
            raise ScriptFailed(f"the script exited with status {code!r}") from None

    return script


def run(script: Callable[[], None], env: Mapping[str, str]) -> int:
    """Run SCRIPT under in-process restart; the Wrapper's own errors end the rank with one line."""
    try:
        build_wrapper(env)(_as_completion(script))()
    except (InprocessError, RetriesExhausted) as exc:
        message = str(exc)
        if not message.startswith("in-process restart"):  # RetryController's messages already say it
            message = f"in-process restart: {message}"
        sys.stderr.write(f"nvrx: {message}\n")
        return FAILED
    return OK
