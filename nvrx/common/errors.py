"""The root of nvrx's own exceptions, and the user-input error every layer raises.

Catching ``NvrxError`` catches anything nvrx raised on purpose (as opposed to a bug or an OS error).
"""

from __future__ import annotations


class NvrxError(Exception):
    """Base class of every exception nvrx defines, except the few that must not be caught by
    ``except Exception`` and so derive from ``BaseException``: the in-process ``RestartInterrupt`` and
    ``RetriesExhausted``, and the bootstrap's ``_NotRunnable`` (tests/unit/test_error_hierarchy.py lists
    them and checks the rest)."""


class ConfigError(NvrxError, ValueError):
    """A value the user gave is wrong; the message is one line saying what and how to fix it."""
