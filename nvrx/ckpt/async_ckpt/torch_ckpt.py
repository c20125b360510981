"""``TorchAsyncCheckpoint``: ``torch.save`` in the background, with NVRx's calls.

``async_save(state_dict, path, ...)`` takes ``torch.save``'s arguments after the object. The object is
serialized during the call (so the file holds the values of that moment; an object that cannot be
saved fails right there) and the writer process writes and fsyncs it; ``finalize_async_save``
publishes finished files under their name (atomic rename; ``NAME.nvrx.json`` records size and digest).
``torch.load(path)`` reads the result.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from nvrx.ckpt.async_ckpt.core import AsyncCallsQueue
from nvrx.ckpt.errors import CheckpointError
from nvrx.ckpt.torch_save_async import torch_save_request

log = logging.getLogger("nvrx.ckpt.torch")

# torch.save's parameters after (obj, f), in its order
_SAVE_PARAMS = ("pickle_module", "pickle_protocol", "_use_new_zipfile_serialization", "_disable_byteorder_record")


class TorchAsyncCheckpoint:
    """Asynchronous ``torch.save`` of one process's state.

    PERSISTENT_QUEUE: True writes on this process's shared writer process; False (NVRx's default) on one of
    this checkpoint object's own, stopped by ``finalize_async_save(terminate=True)``.
    """

    async_fn = None  # NVRx's class attribute; the write here is always the writer process's job

    def __init__(self, persistent_queue: bool = False) -> None:
        self._queue = AsyncCallsQueue(persistent=persistent_queue)

    def async_save(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """``torch.save(state_dict, *args, **kwargs)`` in the background; the file argument must be a path."""
        if args:
            path, rest = args[0], args[1:]
        elif "f" in kwargs:
            path, rest = kwargs.pop("f"), ()
        else:
            raise TypeError("async_save() needs the file to save to: async_save(state_dict, path)")
        if not isinstance(path, (str, os.PathLike)):
            raise CheckpointError(f"async_save writes to a path, not a {type(path).__name__}: the file is written by "
                                  "the writer process and published under its name when finalized")
        if len(rest) > len(_SAVE_PARAMS):
            raise TypeError(f"async_save() takes torch.save's arguments: (state_dict, f, {', '.join(_SAVE_PARAMS)})")
        save_kwargs = dict(zip(_SAVE_PARAMS, rest))
        for key in kwargs:
            if key not in _SAVE_PARAMS or key in save_kwargs:
                raise TypeError(f"async_save() got an unexpected or repeated argument {key!r}")
        save_kwargs.update(kwargs)
        self._queue.schedule_async_request(torch_save_request(state_dict, path, save_kwargs=save_kwargs))

    def finalize_async_save(self, blocking: bool = False, no_dist: bool = True, terminate: bool = False) -> None:
        """Publish the saves that are written (BLOCKING: wait for all); TERMINATE: then stop the writer.

        A failed write raises here (``CheckpointWriteFailed``, also torch's ``CheckpointException``).
        """
        pending = self._queue.get_num_unfinalized_calls()
        if blocking and pending and _rank() == 0:
            log.info("waiting for %d asynchronous torch.save call(s) to finish", pending)
        self._queue.maybe_finalize_async_calls(blocking, no_dist=no_dist)
        if terminate:
            self._queue.close()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
