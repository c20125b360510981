"""The one signal parser of the project (flags, YAML, environment all go through it)."""

from __future__ import annotations

import difflib
import signal

from nvrx.common.errors import ConfigError

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
SIGNAL_HINT = "use a name like SIGKILL or SIGTERM (or TERM, or a number like 15)"


def parse_signal(name: str | int, where: str = "--signals-to-handle") -> signal.Signals:
    """'SIGTERM', 'TERM', 'term' or '15' -> signal.Signals; ConfigError naming WHERE otherwise."""
    text = str(name).strip().upper()
    if text.isdigit():
        try:
            return signal.Signals(int(text))
        except ValueError:
            raise ConfigError(f"{where}: {name!r} is not a signal number on this system; {SIGNAL_HINT}") from None
    text = text if text.startswith("SIG") else "SIG" + text
    try:
        return signal.Signals[text]
    except KeyError:
        guess = difflib.get_close_matches(text, [s.name for s in signal.Signals], n=1, cutoff=0.6)
        tip = f"did you mean {guess[0]}? " if guess else ""
        raise ConfigError(f"{where}: unknown signal {name!r}; {tip}{SIGNAL_HINT}") from None


def parse_signals(value: str) -> tuple[signal.Signals, ...]:
    """A comma-separated list of catchable signals, duplicates dropped, order kept."""
    sigs = []
    for item in str(value).split(","):
        if item.strip():
            sig = parse_signal(item)
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                raise ConfigError(f"--signals-to-handle: {sig.name} cannot be caught; remove it")
            sigs.append(sig)
    return tuple(dict.fromkeys(sigs))
