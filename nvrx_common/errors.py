"""The root of nvrx's own exceptions, and the user-input error every layer raises.

Catching ``NvrxError`` catches anything nvrx raised on purpose (as opposed to a bug or an OS error).
"""

from __future__ import annotations


class NvrxError(Exception):
    """Base class of every exception nvrx defines (``RestartInterrupt`` excepted: it must not be caught
    by ``except Exception``, so it derives from ``BaseException``)."""


class ConfigError(NvrxError, ValueError):
    """A value the user gave is wrong; the message is one line saying what and how to fix it."""
