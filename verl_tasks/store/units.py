"""The commit protocol: a unit is a folder of files made visible all at once.

::

    <unit>/.attempts/<attempt-id>/<file>...   written first, invisible to readers
    <unit>/_SUCCESS                           JSON manifest, created only if absent

The marker write is the commit point. It names the attempt and lists each
file's size and sha256, so a reader can verify what it reads. Two attempts that
race on one unit both write their own attempt folder; exactly one creates the
marker, the loser deletes its folder and returns the winner's record.

Before the marker is written, ``commit`` checks that the attempt is not fenced,
that it was computed under the config the experiment is pinned to (when the
writer carries a ``ConfigPin``), and that every file it lists is there with its
size (one listing). The pin is read again after the marker is written: a re-pin
that landed in between sets the unit aside (``quarantine``), so no unit computed
under an old config stays committed after a re-pin (``verl_tasks.pinning``).
"""
from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_tasks.errors import AttemptFenced, ConfigRepinned, IntegrityError, StoreError, WriteConflict
from verl_tasks.store.base import NotFound, ObjectStore

log = logging.getLogger(__name__)

MARKER = "_SUCCESS"
# Retention deletes a committed unit's weight files but keeps its marker; this flag says so.
PRUNED = "_PRUNED"
ATTEMPTS = ".attempts"
QUARANTINE = ".quarantine"
FENCED = ".fenced"
FORMAT_VERSION = 1


def new_attempt_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:10]


def stamp_time(name: str) -> float | None:
    """Epoch seconds of a ``YYYYmmddTHHMMSS...`` attempt id or stamp, or None."""
    try:
        return float(calendar.timegm(time.strptime(name[:15], "%Y%m%dT%H%M%S")))
    except ValueError:
        return None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class CommitRecord:
    """What a committed unit holds; small and JSON-serialisable (safe for XCom)."""

    unit: str
    attempt: str
    files: dict[str, FileEntry]
    meta: dict[str, Any] = field(default_factory=dict)
    committed_at: float = 0.0
    # The experiment's config hash the unit was computed under (None: written without a pin check).
    config_hash: str | None = None

    def key(self, name: str) -> str:
        if name not in self.files:
            raise NotFound(f"{self.unit}/{name}")
        return f"{self.unit}/{ATTEMPTS}/{self.attempt}/{name}"

    def to_json(self) -> bytes:
        body = asdict(self)
        body["format"] = FORMAT_VERSION
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, unit: str, data: bytes) -> CommitRecord:
        try:
            body = json.loads(data)
            files = {name: FileEntry(int(e["size"]), str(e["sha256"])) for name, e in body["files"].items()}
            if body["unit"] != unit:
                raise ValueError(f"marker names unit {body['unit']!r}")
            pinned = body.get("config_hash")
            return cls(unit, str(body["attempt"]), files, dict(body.get("meta", {})), float(body["committed_at"]),
                       str(pinned) if pinned is not None else None)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise IntegrityError(unit, [f"corrupt {MARKER} marker ({err})"]) from None


def read_marker(store: ObjectStore, unit: str) -> CommitRecord | None:
    """The unit's record, or None if it is not committed. Raises IntegrityError on a corrupt marker."""
    try:
        data = store.get(f"{unit}/{MARKER}")
    except NotFound:
        return None
    return CommitRecord.from_json(unit, data)


def committed_record(store: ObjectStore, unit: str) -> CommitRecord:
    """The record of a unit that must be committed (``read_marker`` without the None).

    Raises:
        StoreError: the unit has no marker (not committed, or removed meanwhile).
        IntegrityError: the marker is corrupt.
    """
    record = read_marker(store, unit)
    if record is None:
        raise StoreError(f"{store.url(unit)} is not committed (no {MARKER})")
    return record


def is_committed(store: ObjectStore, unit: str) -> bool:
    return store.exists(f"{unit}/{MARKER}")


def is_pruned(store: ObjectStore, unit: str) -> bool:
    """True when retention removed the unit's weights (the marker and JSON files remain)."""
    return store.exists(f"{unit}/{PRUNED}")


@dataclass(frozen=True)
class ConfigPin:
    """The config an attempt computes under: ``key`` is the experiment's ``experiment.json``, whose
    ``config_hash`` must still be ``config_hash`` when the attempt commits."""

    key: str
    config_hash: str


def pinned_hash(store: ObjectStore, key: str) -> str | None:
    """The ``config_hash`` of the pin at ``key``; None when there is none (nothing pinned yet).

    Raises:
        StoreError: the pin is damaged, so no commit can be checked against it.
    """
    try:
        data = store.get(key)
    except NotFound:
        return None
    try:
        return str(json.loads(data)["config_hash"])
    except (ValueError, KeyError, TypeError) as err:
        raise StoreError(f"{store.url(key)} is damaged ({type(err).__name__}); no unit can be checked against "
                         f"the experiment's config pin, so none is committed: restore it, or delete it to pin "
                         f"the current config again") from None


class UnitWriter:
    """Collects a unit's files under a fresh attempt prefix, then commits them.

    Use ``write_bytes``/``write_json``/``write_file`` for each file, then
    ``commit(meta)``. Nothing is visible to readers until ``commit`` succeeds.
    ``pin``: the config the attempt computes under; ``commit`` refuses once the
    experiment is pinned to another (``ConfigRepinned``). ``expect`` names files
    the manifest must hold.
    """

    def __init__(self, store: ObjectStore, unit: str, attempt: str | None = None, *, pin: ConfigPin | None = None):
        self.store = store
        self.unit = unit
        self.attempt = attempt or new_attempt_id()
        self.pin = pin
        self.files: dict[str, FileEntry] = {}
        self.expected: set[str] = set()
        self._hashed: dict[str, FileEntry] = {}

    def _attempt_key(self, name: str) -> str:
        if "/" in name or name.startswith(".") or name == MARKER:
            raise StoreError(f"invalid file name {name!r} in unit {self.unit}")
        return f"{self.unit}/{ATTEMPTS}/{self.attempt}/{name}"

    def write_bytes(self, name: str, data: bytes) -> None:
        self.store.put(self._attempt_key(name), data)
        self.files[name] = FileEntry(len(data), sha256_bytes(data))

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json.dumps(obj, sort_keys=True, indent=1).encode())

    def write_jsonl(self, name: str, rows: list[dict[str, Any]]) -> None:
        encode = json.JSONEncoder(sort_keys=True).encode  # json.dumps with options builds one per call
        self.write_bytes(name, "".join(encode(r) + "\n" for r in rows).encode())

    def write_file(self, name: str, path: Path) -> None:
        path = Path(path)
        self.store.put_file(self._attempt_key(name), path)
        self.files[name] = FileEntry(path.stat().st_size, sha256_file(path))

    @contextlib.contextmanager
    def folder(self) -> Iterator[Path]:
        """A local folder for files a library writes itself (an HF policy folder, optimizer state); each
        file in it becomes one of this attempt's when the block ends without an error. On a local store
        the folder is inside the attempt's (files are renamed in, never copied); elsewhere it is uploaded.
        A file whose size and sha256 were noted while it was written (``note_hashed``) is not read back."""
        with self.store.staging(f"{self.unit}/{ATTEMPTS}/{self.attempt}") as stage:
            self._hashed.clear()
            yield stage
            for path in sorted(p for p in stage.iterdir() if p.is_file()):
                self._attempt_key(path.name)  # a name the attempt may hold
                size = path.stat().st_size
                noted = self._hashed.pop(path.name, None)
                self.files[path.name] = noted if noted is not None and noted.size == size else \
                    FileEntry(size, sha256_file(path))

    def note_hashed(self, name: str, size: int, sha256: str) -> None:
        """The size and sha256 of a file of the current ``folder()`` block, computed as it was written."""
        self._hashed[name] = FileEntry(size, sha256)

    def copy_from(self, record: CommitRecord, name: str, as_name: str | None = None) -> None:
        """Copy a verified file of another committed unit into this attempt (server-side)."""
        target = as_name or name
        self.store.copy(record.key(name), self._attempt_key(target))
        self.files[target] = record.files[name]

    def expect(self, *names: str) -> None:
        """Files the manifest must list. A file lost before it was listed (deleted from a staging folder
        before its block ended) is absent from the manifest itself, so no check of the listed files finds it."""
        self.expected.update(names)

    def _missing_files(self) -> list[str]:
        """Expected files never listed, and listed files that are gone or changed size since written (e.g.
        removed by a racing ``gc``): one listing of the attempt's folder (a LIST on S3, not a HEAD per file)."""
        prefix = f"{self.unit}/{ATTEMPTS}/{self.attempt}/"
        present = self.store.sizes(prefix) if self.files else {}
        missing = [f"{name}: never written" for name in sorted(self.expected - set(self.files))]
        for name, entry in sorted(self.files.items()):
            size = present.get(prefix + name)
            if size is None:
                missing.append(f"{name}: missing")
            elif size != entry.size:
                missing.append(f"{name}: {size} bytes, written {entry.size}")
        return missing

    def _check_pin(self) -> None:
        """Refuse (discarding the attempt) when the experiment is no longer pinned to this attempt's config."""
        if self.pin is None:
            return
        pinned = pinned_hash(self.store, self.pin.key)
        if pinned is not None and pinned != self.pin.config_hash:
            self.discard()
            raise ConfigRepinned(self.unit, self.attempt, self.pin.config_hash, pinned)

    def _published(self, record: CommitRecord) -> tuple[CommitRecord, bool]:
        """Our marker is written: read the pin again. A re-pin that landed between the check before the
        marker and the marker itself sets the unit aside again (its re-scan may have run before our marker)."""
        if self.pin is not None:
            pinned = pinned_hash(self.store, self.pin.key)
            if pinned is not None and pinned != self.pin.config_hash:
                mine = read_marker(self.store, self.unit)
                if mine is not None and mine.attempt == self.attempt:
                    quarantine(self.store, self.unit, f"committed under config {self.pin.config_hash[:12]} while "
                                                      f"the experiment was re-pinned to {pinned[:12]}")
                raise ConfigRepinned(self.unit, self.attempt, self.pin.config_hash, pinned)
        return record, True

    def commit(self, meta: dict[str, Any] | None = None) -> tuple[CommitRecord, bool]:
        """Create the marker if absent. Returns (record, won); a loser gets the winner's record.

        Raises:
            AttemptFenced: the attempt was cancelled (its files are discarded).
            ConfigRepinned: the experiment was re-pinned to another config than ``pin``'s (nothing stays
                committed; the files are discarded, or set aside when the re-pin raced the marker).
            StoreError: a listed file of this attempt is gone, so a marker would point at nothing, or an
                expected one was never listed.
            WriteConflict: S3 could not decide the marker write (409s through every backoff) and no marker
                is there: the attempt's files are discarded; retryable.
        """
        try:
            check_not_fenced(self.store, self.unit, self.attempt)
        except AttemptFenced:
            mine = read_marker(self.store, self.unit)
            if mine is not None and mine.attempt == self.attempt:
                # Another copy of this attempt (a call Ray delivered twice) committed before the
                # fence: its files are the unit's now, not this copy's to discard.
                return mine, True
            self.discard()
            raise
        self._check_pin()
        missing = self._missing_files()
        if missing and read_marker(self.store, self.unit) is None:
            raise StoreError(
                f"{self.unit}: attempt {self.attempt} lost files before commit ({'; '.join(missing)}); "
                f"nothing was committed: rerun the task (was `verl-tasks gc` run with a short --older-than?)"
            )
        record = CommitRecord(self.unit, self.attempt, dict(self.files), dict(meta or {}), time.time(),
                              self.pin.config_hash if self.pin else None)
        try:
            if not missing and self.store.put_if_absent(f"{self.unit}/{MARKER}", record.to_json()):
                return self._published(record)
        except WriteConflict as err:
            return self._undecided(err)
        winner = read_marker(self.store, self.unit)
        if winner is None:  # set aside (a re-pin's quarantine) between our write and this read
            self.discard()
            raise StoreError(f"{self.unit}: attempt {self.attempt} met a marker that was gone again when read "
                             f"(set aside by a re-pin?); nothing was committed: rerun the task")
        if winner.attempt == self.attempt:
            # Our write landed but its reply was lost; the client's retry then saw our own marker.
            return self._published(winner)
        self.discard()
        if self.pin is not None and winner.config_hash not in (None, self.pin.config_hash):
            raise ConfigRepinned(self.unit, winner.attempt, winner.config_hash, self.pin.config_hash)
        log.info("unit %s was committed by attempt %s first; discarded %s", self.unit, winner.attempt, self.attempt)
        return winner, False

    def _undecided(self, err: WriteConflict) -> tuple[CommitRecord, bool]:
        """The marker write stayed 409 through every backoff: the marker, if any, decides; else nothing is
        committed, and the attempt's files go (a marker never names them), with a retryable error."""
        winner = read_marker(self.store, self.unit)
        if winner is not None and winner.attempt == self.attempt:
            return self._published(winner)  # an earlier try of ours landed; its reply was lost
        self.discard()
        if winner is not None:
            return winner, False
        raise WriteConflict(err.key, f"{self.unit}: attempt {self.attempt} could not commit: {err}; its files "
                                     f"were discarded and nothing was committed: rerun the task") from err

    def discard(self) -> None:
        """Delete this attempt's files (it lost the race, or was fenced). Files left behind are garbage
        ``gc`` finds (no marker names them), so a failed delete is logged, never the outcome."""
        try:
            self.store.delete_prefix(f"{self.unit}/{ATTEMPTS}/{self.attempt}/")
        except StoreError as err:
            log.warning("could not delete the files of attempt %s of %s (gc will): %s", self.attempt, self.unit, err)


def _fence_key(unit: str, attempt: str) -> str:
    return f"{unit}/{FENCED}/{attempt}.json"


def fence_attempt(store: ObjectStore, unit: str, attempt: str, reason: str) -> None:
    """Forbid ``attempt`` to commit ``unit`` (it was cancelled or timed out; a retry uses a new attempt).

    The check sits right before the marker write, so an attempt that outlives its
    cancellation (a worker not yet killed) discards its files instead of committing.
    """
    store.put(_fence_key(unit, attempt), json.dumps({"reason": reason, "at": time.time()}).encode())


def fence_record(store: ObjectStore, unit: str, attempt: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.get(_fence_key(unit, attempt)))
    except NotFound:
        return None
    except ValueError:
        return {"reason": "fence record unreadable"}


def check_not_fenced(store: ObjectStore, unit: str, attempt: str | None) -> None:
    """Raise ``AttemptFenced`` when ``attempt`` of ``unit`` was cancelled (None: an unnamed inline attempt,
    which nothing fences)."""
    if not attempt:
        return
    fence = fence_record(store, unit, attempt)
    if fence is not None:
        raise AttemptFenced(unit, attempt, str(fence.get("reason", "cancelled")))


def read_bytes(store: ObjectStore, record: CommitRecord, name: str, verify: bool = True) -> bytes:
    """Read one file of a committed unit, checking size and sha256 against the manifest."""
    try:
        data = store.get(record.key(name))
    except NotFound:
        raise IntegrityError(record.unit, [f"{name}: missing"]) from None
    if verify:
        expected = record.files[name]
        if len(data) != expected.size or sha256_bytes(data) != expected.sha256:
            raise IntegrityError(
                record.unit, [f"{name}: size/hash mismatch (have {len(data)} bytes, manifest {expected.size})"]
            )
    return data


def read_json(store: ObjectStore, record: CommitRecord, name: str) -> Any:
    return json.loads(read_bytes(store, record, name))


def read_jsonl(store: ObjectStore, record: CommitRecord, name: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file of a committed unit: a new list of row dicts that callers must not change.

    The bytes are read and verified on every call; their parse is kept per sha256 (a rollout's samples
    are read by score, validate and update, pinned prompts by every unit), for files up to
    ``PARSED_BYTES`` in all, least recently used first out.
    """
    data = read_bytes(store, record, name)
    key = record.files[name].sha256
    with _PARSED_LOCK:
        entry = _PARSED.pop(key, None)
        if entry is None:
            entry = (len(data), json.loads(b"[" + b",".join(line for line in data.splitlines() if line.strip()) + b"]"))
        if entry[0] <= PARSED_BYTES:
            _PARSED[key] = entry
            while sum(size for size, _ in _PARSED.values()) > PARSED_BYTES:
                _PARSED.pop(next(iter(_PARSED)))
    return list(entry[1])


PARSED_BYTES = 32 << 20
_PARSED: dict[str, tuple[int, list[dict[str, Any]]]] = {}
_PARSED_LOCK = threading.Lock()


def download(store: ObjectStore, record: CommitRecord, name: str, path: Path) -> Path:
    """Fetch a file of a committed unit to ``path`` and verify it."""
    try:
        store.get_file(record.key(name), path)
    except NotFound:
        raise IntegrityError(record.unit, [f"{name}: missing"]) from None
    expected = record.files[name]
    if path.stat().st_size != expected.size or sha256_file(path) != expected.sha256:
        raise IntegrityError(record.unit, [f"{name}: size/hash mismatch"])
    return path


def verify_unit(store: ObjectStore, record: CommitRecord) -> list[str]:
    """Every problem found (missing, wrong size, wrong hash); empty when the unit is intact."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, entry in sorted(record.files.items()):
            local = Path(tmp, "f")
            try:
                store.get_file(record.key(name), local)
            except NotFound:
                problems.append(f"{name}: missing")
                continue
            if local.stat().st_size != entry.size:
                problems.append(f"{name}: {local.stat().st_size} bytes, manifest says {entry.size}")
            elif sha256_file(local) != entry.sha256:
                problems.append(f"{name}: sha256 differs from manifest")
            os.unlink(local)
    return problems


def quarantine(store: ObjectStore, unit: str, reason: str) -> str | None:
    """Move a unit's marker aside so the unit reads as absent and can be recomputed.

    The data stays (for a post-mortem) until ``gc``. Returns the quarantine key.
    """
    try:
        data = store.get(f"{unit}/{MARKER}")
    except NotFound:
        return None
    key = f"{unit}/{QUARANTINE}/{new_attempt_id()}.json"
    store.put(key, json.dumps({"reason": reason, "marker": data.decode(errors="replace")}).encode())
    store.delete(f"{unit}/{MARKER}")
    log.warning("quarantined %s: %s", unit, reason)
    return key
