"""Logging of the in-process Wrapper, configured as the spec describes.

In a rank: one ``StreamHandler`` (stderr) on the package logger ``nvrx.launcher.rank.inprocess``, which does not
propagate, so the application's root logger configuration neither receives nor formats our records
and nothing is written to files. Module loggers are children of it. Every record carries the rank's
initial rank and the current iteration.

In the monitor process: a ``FileHandler`` only (``monitor_process_logfile``); no terminal output.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "nvrx.launcher.rank.inprocess"
FORMAT = "%(asctime)s inprocess[rank %(initial_rank)s it %(iteration)s pid %(process)d] %(levelname)s %(message)s"


class _Context(logging.Filter):
    """Stamps records with the rank and iteration this process is in."""

    initial_rank: object = "?"
    iteration: object = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.initial_rank = self.initial_rank
        record.iteration = self.iteration
        return True


context = _Context()


def package_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def setup_rank_logging(level: int = logging.INFO) -> logging.Logger:
    """Give the package logger its own stderr handler (once) and stop propagation."""
    logger = package_logger()
    logger.propagate = False
    if not any(getattr(h, "_inprocess", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._inprocess = True  # type: ignore[attr-defined]
        handler.addFilter(context)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
    return logger


def setup_file_logging(path: str | None, level: int = logging.DEBUG) -> logging.Logger:
    """Monitor process: log only to PATH (nothing at all when PATH is None)."""
    logger = package_logger()
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    if path:
        handler: logging.Handler = logging.FileHandler(path)
        handler.addFilter(context)
        handler.setFormatter(logging.Formatter(FORMAT.replace("inprocess[", "inprocess-monitor[")))
    else:
        handler = logging.NullHandler()
    logger.addHandler(handler)
    logger.setLevel(level)
    return logger


def set_context(initial_rank: int | None = None, iteration: int | None = None) -> None:
    if initial_rank is not None:
        context.initial_rank = initial_rank
    if iteration is not None:
        context.iteration = iteration
