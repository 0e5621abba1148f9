"""A store in a local directory: the embedded default, and a shared filesystem in production."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from verl_tasks.errors import StoreError
from verl_tasks.store.base import NotFound, ObjectStore, check_key


class LocalStore(ObjectStore):
    """Files under ``root``. Writes go to a temp file in the same folder and are
    renamed (or hard-linked, for put-if-absent) into place, so a reader or a
    crash never sees half a file under its final name."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_temp(self, target: Path, data: bytes | None = None, source: Path | None = None) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                if source is not None:
                    with open(source, "rb") as src:
                        shutil.copyfileobj(src, handle, 1 << 20)
                else:
                    handle.write(data or b"")
                handle.flush()
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

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        os.replace(self._write_temp(target, source=Path(path)), target)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._path(key)
        tmp = self._write_temp(target, data)
        try:
            os.link(tmp, target)
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

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if prefix:
            check_key(prefix.rstrip("/") or ".")
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                out.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(out)

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
