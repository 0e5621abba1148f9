"""The storage protocol every backend implements, and key validation.

Keys are ``/``-separated paths relative to the store root. Only this package
touches S3 or the disk; everything else speaks in keys.
"""
from __future__ import annotations

import abc
import builtins
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from verl_tasks.errors import UnsafeKey


def check_key(key: str) -> str:
    """Reject keys that are absolute, empty in a segment, or climb with '..'."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise UnsafeKey(f"unsafe storage key {key!r}: keys are relative '/'-separated paths")
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts[:-1]) or parts[-1] in (".", ".."):
        raise UnsafeKey(f"unsafe storage key {key!r}: no empty, '.' or '..' segments allowed")
    return key


class NotFound(KeyError):
    """The key does not exist in the store."""


class ObjectStore(abc.ABC):
    """A flat key -> bytes store with one atomic primitive: put-if-absent."""

    uri: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) ``key`` atomically: readers see old or new bytes, never a mix."""

    def put_volatile(self, key: str, data: bytes) -> None:
        """Write a record whose loss costs only time atomically, without waiting for it to reach the disk:
        an event (telemetry), retention's watermark (a hint that is true once written).

        Readers never see half of it; a crash of the machine may lose the newest ones. Commit
        markers and unit files never use it. By default the same as ``put``.
        """
        self.put(key, data)

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist. Returns False if it already existed."""

    def make_durable(self) -> None:
        """Make what this process wrote durable now, before another process commits it (an update
        worker's share of an update). The local store defers its attempt folders' fsyncs to the next
        marker written *in this process*; a write to S3 is durable once acknowledged: nothing to do."""
        return None  # deliberately a no-op by default (not abstract): stores that defer fsyncs override it

    @abc.abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """``key``'s bytes and a token naming this version of it, for ``put_if_match``. Raises NotFound."""

    @abc.abstractmethod
    def put_if_match(self, key: str, data: bytes, version: str) -> bool:
        """Replace ``key`` only if it still holds ``version`` (from ``get_versioned``): a compare-and-swap.

        Returns False, writing nothing, when ``key`` changed since or is gone.
        """

    @abc.abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (multipart for large files on S3)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Read ``key``. Raises NotFound."""

    @abc.abstractmethod
    def get_file(self, key: str, path: Path) -> None:
        """Download ``key`` into a local file. Raises NotFound."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes. Raises NotFound."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (recursive), sorted."""

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` -> its size in bytes, from one listing where the backend has one
        (how a commit checks that every file its marker will list is there)."""
        out = {}
        for key in self.list(prefix):
            try:
                out[key] = self.size(key)
            except NotFound:  # deleted since the listing
                continue
        return out

    @abc.abstractmethod
    def folders(self, limit: int) -> builtins.list[str]:  # builtins: ``list`` is the method above
        """The first ``limit`` top-level folder names at the store's root, sorted: a bounded look at what it holds."""

    @abc.abstractmethod
    def list_modified(self, prefix: str) -> dict[str, float]:
        """Every key under ``prefix`` -> its last write (epoch seconds).

        How ``gc`` tells a live attempt from a dead one.
        """

    def temp_files(self, prefix: str) -> dict[str, float]:
        """Half-written temp files under ``prefix`` -> last write; none for stores that write in place."""
        return {}

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    @abc.abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Copy within the store (server-side on S3, a hard link in a local folder)."""

    @contextlib.contextmanager
    def staging(self, prefix: str) -> Iterator[Path]:
        """A local folder for files a library writes itself (``save_pretrained``, safetensors): when the
        block ends without an error, each file in it becomes ``prefix/<name>``. Here: uploaded from a
        temporary folder, which is then removed."""
        with tempfile.TemporaryDirectory(prefix="vt-stage-") as tmp:
            folder = Path(tmp)
            yield folder
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    self.put_file(f"{prefix.rstrip('/')}/{path.name}", path)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)

    def url(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"
