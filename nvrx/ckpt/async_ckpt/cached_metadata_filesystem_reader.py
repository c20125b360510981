"""``CachedMetadataFileSystemReader``: a DCP ``FileSystemReader`` that reads a checkpoint's ``.metadata`` once.

Loading a large checkpoint unpickles its metadata on every rank for every load call (Megatron-Core
loads in several passes). The cache is shared by all readers of this process. It is keyed by the
checkpoint path *and* the identity of its ``.metadata`` file (inode, size, modification time), so a
checkpoint republished under the same name (our publish renames a new directory into place) is
never answered from a stale entry.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from torch.distributed.checkpoint import FileSystemReader, Metadata


class CachedMetadataFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` is cached per checkpoint (CACHE_METADATA=False: never)."""

    _metadata_cache: ClassVar[dict[tuple, Metadata]] = {}

    def __init__(self, path: str | os.PathLike, cache_metadata: bool = True) -> None:
        super().__init__(path=path)
        self._cache_metadata = cache_metadata
        self._abs_path = os.path.abspath(os.fspath(path))

    def _cache_key(self, rank: int | None) -> tuple:
        path = os.fspath(self._get_metadata_path(rank))
        st = os.stat(path)
        return self._abs_path, path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not self._cache_metadata:
            return super().read_metadata(*args, **kwargs)
        key = self._cache_key(kwargs.get("rank"))
        cached = self._metadata_cache.get(key)
        if cached is None:
            cached = super().read_metadata(*args, **kwargs)
            for old in [k for k in self._metadata_cache if k[:2] == key[:2]]:  # an older version of this checkpoint
                del self._metadata_cache[old]
            self._metadata_cache[key] = cached
        elif getattr(cached, "storage_meta", None) is not None:
            cached.storage_meta.load_id = self.load_id  # this load's id, as an uncached read gives
        return cached

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget every cached metadata (e.g. when a restarted job reuses this process)."""
        cls._metadata_cache.clear()
