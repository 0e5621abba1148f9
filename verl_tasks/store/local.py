"""A store in a local directory: the embedded default, and a shared filesystem in production."""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

from verl_tasks.errors import StoreError
from verl_tasks.store.base import NotFound, ObjectStore, check_key


class LocalStore(ObjectStore):
    """Files under ``root``. Writes go to a temp file in the same folder and are
    renamed (or hard-linked, for put-if-absent) into place, so a reader or a
    crash never sees half a file under its final name; the folder is fsynced
    after, so a committed marker survives a power loss. Files and folders get
    the usual modes under the umask (group-readable on a shared volume)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _makedirs(self, folder: Path) -> None:
        """Create ``folder`` and missing parents, fsyncing each new entry's parent."""
        if folder.is_dir():
            return
        self._makedirs(folder.parent)
        try:
            folder.mkdir()
        except FileExistsError:
            return
        _fsync_dir(folder.parent)

    def _write_temp(self, target: Path, data: bytes | None = None, source: Path | None = None,
                    sync: bool = True) -> Path:
        if sync:
            self._makedirs(target.parent)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
        # 0o666 under the umask (mkstemp would make it 0600, unreadable to the group).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as handle:
                if source is not None:
                    with open(source, "rb") as src:
                        shutil.copyfileobj(src, handle, 1 << 20)
                else:
                    handle.write(data or b"")
                handle.flush()
                if sync:
                    os.fsync(handle.fileno())
        except OSError as err:
            Path(tmp).unlink(missing_ok=True)
            if err.errno == errno.ENOSPC:
                raise StoreError(
                    f"no space left on the device holding {self.root} while writing {target.name}; "
                    f"free space (try `verl-tasks gc`) and retry: nothing was committed"
                ) from err
            raise
        return Path(tmp)

    def put(self, key: str, data: bytes) -> None:
        target = self._path(key)
        os.replace(self._write_temp(target, data), target)
        _fsync_dir(target.parent)

    def put_log(self, key: str, data: bytes) -> None:
        """Like ``put`` (temp file renamed into place) without the fsyncs: events are telemetry."""
        target = self._path(key)
        os.replace(self._write_temp(target, data, sync=False), target)

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        os.replace(self._write_temp(target, source=Path(path)), target)
        _fsync_dir(target.parent)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._path(key)
        tmp = self._write_temp(target, data)
        try:
            os.link(tmp, target)
            _fsync_dir(target.parent)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(key) from None

    def get_file(self, key: str, path: Path) -> None:
        source = self._path(key)
        if not source.is_file():
            raise NotFound(key)
        shutil.copyfile(source, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(key) from None

    def _walk(self, prefix: str, temp: bool) -> list[Path]:
        """Files under ``prefix``: the committed-or-attempt files, or (``temp``) only the ``.tmp-`` ones."""
        base = self.root / prefix if prefix else self.root
        if prefix:
            check_key(prefix.rstrip("/") or ".")
        if base.is_file():
            return [] if temp else [base]
        out = []
        for dirpath, _dirs, files in os.walk(base):
            out.extend(Path(dirpath, name) for name in files if name.startswith(".tmp-") == temp)
        return out

    def _key_of(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if prefix:
            check_key(prefix.rstrip("/") or ".")
        if base.is_file():
            return [self._key_of(base)]
        # Plain strings, not Path objects: status and the dashboard list tens of thousands of keys.
        start = len(str(self.root)) + 1
        return sorted(os.path.join(folder, name)[start:] for folder, _dirs, files in os.walk(base)
                      for name in files if not name.startswith(".tmp-"))

    def folders(self, limit: int) -> list[str]:
        try:
            names = sorted(entry.name for entry in os.scandir(self.root)
                           if entry.is_dir() and not entry.name.startswith("."))
        except FileNotFoundError:
            return []
        return names[:limit]

    def _mtimes(self, paths: list[Path]) -> dict[str, float]:
        out = {}
        for path in paths:
            try:
                out[self._key_of(path)] = path.stat().st_mtime
            except FileNotFoundError:  # renamed or deleted since the walk
                continue
        return out

    def list_modified(self, prefix: str) -> dict[str, float]:
        return self._mtimes(self._walk(prefix, temp=False))

    def temp_files(self, prefix: str) -> dict[str, float]:
        return self._mtimes(self._walk(prefix, temp=True))

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        parent = path.parent
        while parent != self.root and parent.is_dir():
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def copy(self, src: str, dst: str) -> None:
        source = self._path(src)
        if not source.is_file():
            raise NotFound(src)
        self.put_file(dst, source)


def _fsync_dir(folder: Path) -> None:
    """Make a rename, link or new entry in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:  # some network and FUSE filesystems cannot fsync a folder
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
