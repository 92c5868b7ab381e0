"""The record / replay store: one SQLite database in WAL mode mapping a request (a JSON object) to its result.

    store = ResultStore("/shared/runs/nq.searches.sqlite")        # created when missing (create=False: must exist)
    store.pin("sha256:...")             # the index the entries come from; another one raises StoreMismatchError
    store.put_many([({"tool": "search", "query": "q", ...}, [{"id": ...}, ...])])   # -> rows newly written
    store.get_many([{"tool": "search", "query": "q", ...}])                         # -> [result | None]
    len(store)                                                                      # entries in the store

It does not care which tool it serves: a key is any JSON object (`search`: source, index, topk, query; a document
tool: id and page), stored as its canonical JSON text, and a result is any JSON value. The client's record / replay
layer (rsearch_verl/search/replay.py) decides what goes in.

Every rollout worker of every host may write at once: each process opens its own connection (reopened after a fork),
SQLite's WAL journal lets readers go on while one writer commits, `busy_timeout` makes a writer wait its turn instead
of failing, and each `put_many` is one `BEGIN IMMEDIATE` transaction, so a process killed mid-write leaves the entries
of its earlier transactions and nothing of the interrupted one (no torn entry). An entry is never overwritten
(`INSERT OR IGNORE`): the first result recorded for a key is the one every replay sees. `synchronous=NORMAL`: a
committed entry survives a killed process; a power cut may lose the last commits, never corrupt the file.
WAL needs shared memory between the processes using the file: a network filesystem (NFS, CIFS, Lustre) is unsafe
(docs/search_backends.md); `filesystem_type(path)` names it so the run can warn.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
BUSY_TIMEOUT_S = 60.0  # a writer waits this long for the others' transactions before giving up
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "9p")
_IN_CHUNK = 500  # keys per SELECT ... IN (...) (SQLite's default limit on bound parameters is 32766)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, value TEXT NOT NULL, created_at REAL NOT NULL)",
)


class StoreError(RuntimeError):
    """The store cannot be opened or used (missing, not a store, a newer schema, a locked-out writer)."""


class StoreMismatchError(StoreError):
    """The store was recorded against another index than the one this run would use."""


def canonical_key(request: dict) -> str:
    """The text a request is stored under: JSON with sorted keys and no spaces (the same request, the same key)."""
    return json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def filesystem_type(path: str) -> str | None:
    """The filesystem type (`/proc/mounts`) of the mount holding `path`'s directory, or None where unknown."""
    target = os.path.realpath(os.path.dirname(os.path.abspath(path)) or ".")
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return None
    return kind


def on_network_filesystem(path: str) -> bool:
    kind = filesystem_type(path)
    return kind is not None and (kind in NETWORK_FILESYSTEMS or kind.startswith("fuse."))


class ResultStore:
    """A request -> result map in one SQLite file, safe for many writer processes and threads: each thread of each
    process has its own connection, so a lookup on the event loop never waits behind a writer thread's busy wait."""

    def __init__(self, path: str, *, create: bool = True, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = os.path.abspath(path)
        self.busy_timeout_s = busy_timeout_s
        if not create and not os.path.isfile(self.path):
            raise StoreError(f"no record/replay store at {self.path}")
        # this process's connections by thread; a thread that ended has its connection closed when another opens one
        self._conns: dict[int, tuple[threading.Thread, sqlite3.Connection]] = {}
        self._conns_lock = threading.Lock()
        self._pid = os.getpid()
        self._setup_pid = -1  # the process that made sure of the schema
        self._connection()  # open (and create) now: a bad path fails where the store is configured

    # ---- public API -------------------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str | None:
        """The index fingerprint the store is pinned to (None: nothing pinned yet)."""
        return self.meta("fingerprint")

    def meta(self, name: str) -> str | None:
        row = self._connection().execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    def pin(self, fingerprint: str) -> None:
        """Pin the store to `fingerprint` (the first caller of any process wins); raise StoreMismatchError naming both
        when it is pinned to another one."""
        with _Transaction(self._connection()) as conn:
            conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('fingerprint', ?)", (fingerprint,))
            pinned = conn.execute("SELECT value FROM meta WHERE name = 'fingerprint'").fetchone()[0]
        check_fingerprint(self.path, pinned, fingerprint)

    def get_many(self, requests: list[dict]) -> list[Any | None]:
        """The stored result of each request, None where there is none."""
        keys = [canonical_key(r) for r in requests]
        conn = self._connection()
        unique = list(dict.fromkeys(keys))
        found: dict[str, str] = {}
        for start in range(0, len(unique), _IN_CHUNK):
            chunk = unique[start : start + _IN_CHUNK]
            marks = ",".join("?" * len(chunk))
            found.update(conn.execute(f"SELECT key, value FROM entries WHERE key IN ({marks})", chunk).fetchall())
        return [json.loads(found[k]) if k in found else None for k in keys]

    def put_many(self, items: Iterable[tuple[dict, Any]]) -> int:
        """Write each (request, result) not stored yet, all in one transaction; return how many were new."""
        now = time.time()
        rows = [(canonical_key(req), json.dumps(result, ensure_ascii=False), now) for req, result in items]
        if not rows:
            return 0
        with _Transaction(self._connection()) as conn:
            before = conn.total_changes
            conn.executemany("INSERT OR IGNORE INTO entries (key, value, created_at) VALUES (?, ?, ?)", rows)
            return conn.total_changes - before

    def __len__(self) -> int:
        return int(self._connection().execute("SELECT count(*) FROM entries").fetchone()[0])

    def close(self) -> None:
        """Close this process's connections (a later call opens new ones)."""
        with self._conns_lock:
            conns, self._conns = self._conns, {}
        if self._pid == os.getpid():
            for _, conn in conns.values():
                conn.close()

    # ---- internals --------------------------------------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        """This thread's connection in this process (a forked child must not use its parent's)."""
        held = self._conns.get(threading.get_ident())
        if held is not None and held[0] is threading.current_thread() and self._pid == os.getpid():
            return held[1]
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            if self._setup_pid != os.getpid():
                self._set_up(conn)
            conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not a usable record/replay store: {exc}") from exc
        with self._conns_lock:
            if self._pid != os.getpid():  # forked: the parent's connections are not ours to use or close
                self._conns, self._pid = {}, os.getpid()
            for ident, (thread, old) in list(self._conns.items()):
                if not thread.is_alive():  # e.g. an executor thread of an event loop that is gone
                    old.close()
                    del self._conns[ident]
            self._conns[threading.get_ident()] = (threading.current_thread(), conn)
        return conn

    def _set_up(self, conn: sqlite3.Connection) -> None:
        """WAL mode and the tables (once per process; both persist in the file)."""
        self._set_wal(conn)
        with _Transaction(conn) as txn:
            for statement in _SCHEMA:
                txn.execute(statement)
            txn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))
            schema = txn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()[0]
        if schema != SCHEMA_VERSION:
            raise StoreError(f"{self.path} has store schema {schema}; this version reads schema {SCHEMA_VERSION}")
        self._setup_pid = os.getpid()

    def _set_wal(self, conn: sqlite3.Connection) -> None:
        # the switch to WAL takes an exclusive lock once per file; writers creating the file together may collide,
        # and SQLite answers that with "locked" at once instead of waiting (busy_timeout does not cover it)
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if str(mode).lower() != "wal":
            raise StoreError(f"{self.path}: SQLite could not switch the store to WAL mode (journal_mode={mode})")


def check_fingerprint(path: str, pinned: str | None, fingerprint: str) -> None:
    """Raise StoreMismatchError naming both when the store at `path` is pinned to another index than `fingerprint`."""
    if pinned is not None and pinned != fingerprint:
        raise StoreMismatchError(
            f"the record/replay store {path} was recorded against the index with fingerprint {pinned}, but this "
            f"run's index has fingerprint {fingerprint}: replay it against the index it was recorded from, or record "
            "a new store"
        )


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT` (ROLLBACK on an error): the write lock is taken up front, so two writers never
    deadlock upgrading a read lock, and busy_timeout makes the second one wait."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        self.conn.execute("ROLLBACK" if exc_type is not None else "COMMIT")
