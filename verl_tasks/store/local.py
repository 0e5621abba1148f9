"""A store in a local directory: the embedded default, and a shared filesystem in production."""
from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from verl_tasks.errors import StoreError
from verl_tasks.store.base import NotFound, ObjectStore, check_key


class LocalStore(ObjectStore):
    """Files under ``root``. Writes go to a temp file in the same folder and are
    renamed (or hard-linked, for put-if-absent) into place, so a reader or a
    crash never sees half a file under its final name; the folder is fsynced
    after, so a committed marker survives a power loss. Files and folders get
    the usual modes under the umask (group-readable on a shared volume).

    An attempt's files (keys under ``/.attempts/``) are invisible until a marker
    names them, so the fsyncs of their data and of the attempt's own folders wait
    for the next marker write in this process; ``put_if_absent`` issues them all at
    once (concurrent fsyncs share journal commits) and writes the marker only when
    every one has returned. Folders that other units share (the unit's,
    ``.attempts``, the epoch's) are synced when created. A process that hands its
    attempt files to another to commit (an update worker) calls ``make_durable`` first."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _makedirs(self, folder: Path) -> None:
        """Create ``folder`` and missing parents, fsyncing each new entry's parent.

        The fsync of an attempt's own folder (and any inside it) waits for the next marker; a folder
        above it (the unit's, its ``.attempts``, the epoch's) is synced at once: other processes'
        units share it and will not sync an entry they found already there.
        """
        if folder.is_dir():
            return
        self._makedirs(folder.parent)
        try:
            folder.mkdir()
        except FileExistsError:
            return
        _sync_dir(folder.parent, folder.is_relative_to(self.root) and _invisible(self._key_of(folder)))

    def _write_temp(self, target: Path, data: bytes | None = None, source: Path | None = None,
                    sync: bool = True) -> Path:
        try:
            self._makedirs(target.parent)  # an event's folder too: it may be the experiment's first
        except OSError as err:  # the folder's own fsync can be the write the full disk refuses
            if err.errno == errno.ENOSPC:
                raise self._no_space(target.name) from err
            raise
        tmp = _in_flight_name(target.parent)
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
                raise self._no_space(target.name) from err
            raise
        return Path(tmp)

    def _no_space(self, what: str) -> StoreError:
        return StoreError(f"no space left on the device holding {self.root} while writing {what}; "
                          f"free space (try `verl-tasks gc`) and retry: nothing was committed")

    def put(self, key: str, data: bytes) -> None:
        target, later = self._path(key), _invisible(key)
        os.replace(self._write_temp(target, data, sync=not later), target)
        _sync_file(target, later)
        _sync_dir(target.parent, later)

    def put_volatile(self, key: str, data: bytes) -> None:
        """Like ``put`` (temp file renamed into place) without fsyncing the file or its rename.
        A folder it creates is still made durable, once."""
        target = self._path(key)
        os.replace(self._write_temp(target, data, sync=False), target)

    def put_file(self, key: str, path: Path) -> None:
        target, later = self._path(key), _invisible(key)
        os.replace(self._write_temp(target, source=Path(path), sync=not later), target)
        _sync_file(target, later)
        _sync_dir(target.parent, later)

    def make_durable(self) -> None:
        sync_deferred()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._path(key)
        sync_deferred()  # the files a marker names are durable before the marker can be
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

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The bytes and their sha256: the version is the content, so an unchanged file always matches."""
        data = self.get(key)
        return data, hashlib.sha256(data).hexdigest()

    def put_if_match(self, key: str, data: bytes, version: str) -> bool:
        """Compare and swap under an exclusive ``flock`` of the key's lock file (``.locks/`` at the root):
        every ``put_if_match`` of the key takes it, so the compare and the rename are one step for them.
        The kernel drops the lock when its holder dies: no stale lock to break."""
        with self._locked(key):
            try:
                current = self._path(key).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                return False
            if hashlib.sha256(current).hexdigest() != version:
                return False
            self.put(key, data)
            return True

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        folder = self.root / _LOCKS
        self._makedirs(folder)
        path = folder / (hashlib.sha256(check_key(key).encode()).hexdigest()[:32] + ".lock")
        with _CAS_LOCK:  # a flock emulated over NFS is per process: threads of one process wait here
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except PermissionError:  # another user's lock file on a shared volume: a local flock needs no write
                fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

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
        out: list[Path] = []
        for dirpath, _dirs, files in os.walk(base):
            if self._staged(dirpath):  # inside a staging folder (``staging``): every file is in flight
                out.extend(Path(dirpath, name) for name in files if temp)
                continue
            out.extend(Path(dirpath, name) for name in files if name.startswith(".tmp-") == temp)
        return out

    def sizes(self, prefix: str) -> dict[str, int]:
        out = {}
        for path in self._walk(prefix, temp=False):
            try:
                out[self._key_of(path)] = path.stat().st_size
            except FileNotFoundError:  # renamed or deleted since the walk
                continue
        return out

    def _staged(self, folder: str) -> bool:
        """True for a folder at or under a ``.tmp-`` staging folder of this store."""
        return _IN_FLIGHT in folder[len(str(self.root)):]

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
                      if not self._staged(folder) for name in files if not name.startswith(".tmp-"))

    def folders(self, limit: int) -> builtins.list[str]:  # builtins: ``list`` is the method above
        try:
            names = sorted(entry.name for entry in os.scandir(self.root)
                           if entry.is_dir() and not entry.name.startswith("."))
        except FileNotFoundError:
            return []
        return names[:limit]

    def _mtimes(self, paths: builtins.list[Path]) -> dict[str, float]:
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
        """A hard link: nothing in the store changes a file in place (every write is a new file renamed
        into place), so a second name for the same bytes is a copy that writes nothing. A snapshot
        publishing the update's weights costs no second write of them. The flip side: damage done to
        the bytes on disk shows under both names (``phases.fallback`` then recomputes both units).
        A filesystem without hard links gets a real copy."""
        source = self._path(src)
        if not source.is_file():
            raise NotFound(src)
        target, later = self._path(dst), _invisible(dst)
        self._makedirs(target.parent)
        tmp = _in_flight_name(target.parent)
        try:
            os.link(source, tmp)
        except OSError as err:
            if err.errno not in _NO_HARD_LINKS:
                raise
            self.put_file(dst, source)
            return
        os.replace(tmp, target)
        _sync_dir(target.parent, later)

    @contextlib.contextmanager
    def staging(self, prefix: str) -> Iterator[Path]:
        """A ``.tmp-`` folder inside ``prefix``'s own: its files are fsynced and renamed into place when
        the block ends (the same filesystem: no copy). Readers and ``list`` never look inside it."""
        folder = self._path(prefix.rstrip("/"))
        later = _invisible(prefix.rstrip("/") + "/")
        self._makedirs(folder)
        stage = _in_flight_name(folder)
        stage.mkdir()
        try:
            yield stage
            for path in sorted(stage.iterdir()):
                if path.is_file():
                    if not later:
                        _fsync_file(path)
                    os.replace(path, folder / path.name)
                    _sync_file(folder / path.name, later)
            _sync_dir(folder, later)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise self._no_space(prefix) from err
            raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)


_IN_FLIGHT = f"{os.sep}.tmp-"  # a path through a staging folder
_LOCKS = ".locks"  # the lock files of put_if_match, at the store's root (no experiment lists it)
_CAS_LOCK = threading.Lock()


def _in_flight_name(folder: Path) -> Path:
    """A fresh ``.tmp-`` name in ``folder``: a file or folder being written, invisible to readers."""
    return folder / f".tmp-{uuid.uuid4().hex}"
# Where os.link reports a filesystem (or its mount) without hard links; LocalStore.copy then copies.
_NO_HARD_LINKS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}

# Folders with new entries (attempt files, their new folders) not yet fsynced, process-wide: a
# marker may be written through another LocalStore object than its files were.
_DEFERRED: set[Path] = set()
_DEFERRED_FILES: set[Path] = set()  # attempt files whose data is not yet fsynced
_DEFERRED_LOCK = threading.Lock()


def _invisible(key: str) -> bool:
    """True for an attempt's files: no reader looks at them until a marker names them."""
    return "/.attempts/" in key


def _sync_dir(folder: Path, later: bool) -> None:
    if later:
        with _DEFERRED_LOCK:
            _DEFERRED.add(folder)
    else:
        _fsync_dir(folder)


def _sync_file(path: Path, later: bool) -> None:
    """Defer the fsync of an attempt file's data (already renamed into place) to the next marker."""
    if later:
        with _DEFERRED_LOCK:
            _DEFERRED_FILES.add(path)


def sync_deferred() -> int:
    """Fsync every deferred file and folder, several at once; returns how many. Held under the lock
    while syncing, so a marker writer that finds the sets empty knows they are on disk.

    Concurrent fsyncs share the filesystem's journal commits (ext4, xfs): N of them cost about
    what a few sequential ones do.
    """
    with _DEFERRED_LOCK:
        jobs: list[tuple[Callable[[Path], None], Path]] = [(_fsync_file, path) for path in _DEFERRED_FILES]
        jobs += [(_fsync_dir, folder) for folder in _DEFERRED]
        if len(jobs) > 1:
            _syncer().run(jobs)
        elif jobs:
            _fsync_present(*jobs[0])
        _DEFERRED_FILES.clear()
        _DEFERRED.clear()
    return len(jobs)


def _fsync_present(fsync, path: Path) -> None:
    try:
        fsync(path)
    except FileNotFoundError:  # a discarded attempt: nothing to make durable
        pass


class _FsyncThreads:
    """A few daemon threads that run a batch of fsyncs at once: a process ends without waiting for
    them, and a child forked after they started gets its own (threads do not survive a fork)."""

    def __init__(self, size: int) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(size):
            threading.Thread(target=self._work, name=f"verl-tasks-fsync-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            fsync, path, done = self._jobs.get()
            try:
                _fsync_present(fsync, path)
                done.put(None)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller, which raises it
                done.put(err)

    def run(self, jobs: list[tuple[Callable[[Path], None], Path]]) -> None:
        """Run every ``fsync(path)`` and return when all have; the first error is raised."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        for fsync, path in jobs:
            self._jobs.put((fsync, path, done))
        errors = [err for err in (done.get() for _ in jobs) if err is not None]
        if errors:
            raise errors[0]


_SYNCER: list[_FsyncThreads] = []


def _syncer() -> _FsyncThreads:
    if not _SYNCER or _SYNCER[0].pid != os.getpid():
        _SYNCER[:] = [_FsyncThreads(8)]
    return _SYNCER[0]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
