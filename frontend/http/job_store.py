"""The Batch API's state in SQLite: files, batches, each batch's lines, and the runners
working on them.

A batch's lines are its unit of work and of record: a line is `pending`, `claimed` by
one runner (a gateway process) while its images are generated, or `done` with its
output or error line. A runner writes a line's result only while it still holds the
claim, in the same transaction as the batch's counts, so every custom_id ends up in
the output or error file exactly once whatever crashes in between. Claims of a runner
that stopped beating (or whose process is gone, on this host) return to `pending`: a
restarted gateway, or another one on the same state dir, resubmits them. Finalizing a
batch is claimed the same way, and webhook deliveries too.

Statuses follow OpenAI's: validating → in_progress → finalizing → completed, and
cancelling → cancelled, finalizing → expired at the end of the completion window.
`ending` says which end a batch in `finalizing` or `cancelling` is heading for.

One connection per process, used from the event loop's thread: each call is a few
small statements (WAL mode, so readers never wait for the writer).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sqlite3
import time
from typing import Iterable

from engine.processes import pid_alive

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, object TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, caller TEXT NOT NULL, status TEXT NOT NULL, ending TEXT,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    metadata TEXT, base_url TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, expired_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT,
    total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    claimed_by TEXT, webhook_url TEXT, webhook_state TEXT, webhook_attempts INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL, claimed_by TEXT, ok INTEGER, result TEXT,
    PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (state, batch_id);
CREATE TABLE IF NOT EXISTS runners (id TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL,
    beat_at REAL NOT NULL);
"""

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "cancelled", "expired")
LEASE_S = 15.0  # a runner silent this long is gone: its claims return to the queue
_BATCH_COLUMNS = ("id", "owner", "caller", "status", "ending", "endpoint", "input_file_id", "completion_window",
                  "metadata", "base_url", "created_at", "expires_at", "in_progress_at", "finalizing_at",
                  "completed_at", "failed_at", "cancelling_at", "cancelled_at", "expired_at", "output_file_id",
                  "error_file_id", "errors", "total", "completed", "failed", "claimed_by", "webhook_url",
                  "webhook_state", "webhook_attempts")


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def _now() -> int:
    return int(time.time())


class JobStore:
    def __init__(self, path: str | os.PathLike, runner_id: str | None = None, lease_s: float = LEASE_S):
        self.db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses nothing committed before the last fsync
        self.db.executescript(SCHEMA)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.runner_id = runner_id or f"{self.host}:{self.pid}:{secrets.token_hex(4)}"
        self.lease_s = lease_s

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def transaction(self):
        """BEGIN IMMEDIATE … COMMIT: other processes on the same file wait for it."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ------------------------------------------------------------------ files
    def add_file(self, owner: str, purpose: str, filename: str, nbytes: int, object_name: str, file_id: str,
                 expires_at: int | None = None) -> dict:
        created = _now()
        self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (file_id, owner, purpose, filename, nbytes, created, expires_at, object_name))
        return self.get_file(owner, file_id)

    def count_files(self, owner: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM files WHERE owner = ?", (owner,)).fetchone()[0]

    def get_file(self, owner: str, file_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return dict(row) if row else None

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                   descending: bool = True) -> tuple[list[dict], bool]:
        order = "DESC" if descending else "ASC"
        query, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose:
            query, args = query + " AND purpose = ?", args + [purpose]
        if after:
            anchor = self.db.execute("SELECT created_at, id FROM files WHERE id = ? AND owner = ?",
                                     (after, owner)).fetchone()
            if anchor:
                sign = "<" if descending else ">"
                query += f" AND (created_at, id) {sign} (?, ?)"
                args += [anchor["created_at"], anchor["id"]]
        rows = self.db.execute(f"{query} ORDER BY created_at {order}, id {order} LIMIT ?", args + [limit + 1])
        rows = [dict(r) for r in rows]
        return rows[:limit], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> dict | None:
        row = self.get_file(owner, file_id)
        if row:
            self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return row

    # ------------------------------------------------------------------ batches
    def count_active(self, owner: str | None = None) -> int:
        query = f"SELECT COUNT(*) FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))})"
        args = list(ACTIVE)
        if owner is not None:
            query, args = query + " AND owner = ?", args + [owner]
        return self.db.execute(query, args).fetchone()[0]

    def create_batch(self, *, owner: str, caller: str, endpoint: str, input_file_id: str, completion_window: str,
                     window_s: int, metadata: dict | None, base_url: str, webhook_url: str | None,
                     lines: list[tuple[str, str]], refused: dict[int, str], max_active: int) -> dict | None:
        """A batch in `validating` with its lines (`lines`: (custom_id, body JSON); `refused`:
        line index → its error line, already done). None when `max_active` batches are
        active already (checked in the same transaction, so concurrent creates agree)."""
        batch_id, created = new_id("batch_"), _now()
        with self.transaction() as db:
            if max_active and self.count_active() >= max_active:
                return None
            db.execute("INSERT INTO batches (id, owner, caller, status, endpoint, input_file_id, completion_window, "
                       "metadata, base_url, created_at, expires_at, total, failed, webhook_url) "
                       "VALUES (?, ?, ?, 'validating', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (batch_id, owner, caller, endpoint, input_file_id, completion_window,
                        json.dumps(metadata) if metadata is not None else None, base_url, created,
                        created + window_s, len(lines), len(refused), webhook_url))
            db.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, body, state, ok, result) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(batch_id, i, custom_id, body, "done" if i in refused else "pending", 0 if i in refused else None,
                  refused.get(i)) for i, (custom_id, body) in enumerate(lines)])
        return self.get_batch(owner, batch_id)

    def get_batch(self, owner: str | None, batch_id: str) -> dict | None:
        if owner is None:
            row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        else:
            row = self.db.execute("SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)).fetchone()
        return dict(row) if row else None

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        query, args = "SELECT * FROM batches WHERE owner = ?", [owner]
        if after:
            anchor = self.db.execute("SELECT created_at, id FROM batches WHERE id = ? AND owner = ?",
                                     (after, owner)).fetchone()
            if anchor:
                query += " AND (created_at, id) < (?, ?)"
                args += [anchor["created_at"], anchor["id"]]
        rows = [dict(r) for r in self.db.execute(f"{query} ORDER BY created_at DESC, id DESC LIMIT ?",
                                                 args + [limit + 1])]
        return rows[:limit], len(rows) > limit

    def cancel_batch(self, owner: str, batch_id: str) -> dict | None:
        """validating / in_progress → cancelling; other statuses are left as they are."""
        self.db.execute("UPDATE batches SET status = 'cancelling', ending = 'cancelled', cancelling_at = ? "
                        "WHERE id = ? AND owner = ? AND status IN ('validating', 'in_progress')",
                        (_now(), batch_id, owner))
        return self.get_batch(owner, batch_id)

    def statuses(self, batch_ids: Iterable[str]) -> dict[str, str]:
        ids = list(set(batch_ids))
        if not ids:
            return {}
        rows = self.db.execute(f"SELECT id, status FROM batches WHERE id IN ({','.join('?' * len(ids))})", ids)
        return {row["id"]: row["status"] for row in rows}

    # ------------------------------------------------------------------ runners
    def beat(self) -> None:
        """Say this runner is alive; forget the claims of runners that are not."""
        now = time.time()
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO runners VALUES (?, ?, ?, ?)", (self.runner_id, self.host, self.pid, now))
            gone = [row["id"] for row in db.execute("SELECT * FROM runners WHERE id != ?", (self.runner_id,))
                    if now - row["beat_at"] > self.lease_s or self._gone_here(row)]
            for runner in gone:
                db.execute("UPDATE lines SET state = 'pending', claimed_by = NULL WHERE state = 'claimed' "
                           "AND claimed_by = ?", (runner,))
                db.execute("UPDATE batches SET claimed_by = NULL WHERE claimed_by = ?", (runner,))
                db.execute("UPDATE batches SET webhook_state = 'pending' WHERE webhook_state = ?",
                           (f"sending:{runner}",))
                db.execute("DELETE FROM runners WHERE id = ?", (runner,))

    def _gone_here(self, row) -> bool:
        """A runner of this host whose process is gone (or is this one's: a restart that got
        the same pid, as in a restarted container)."""
        return row["host"] == self.host and (row["pid"] == self.pid or not pid_alive(row["pid"]))

    def leave(self) -> None:
        """A clean stop: hand this runner's claims back at once."""
        with self.transaction() as db:
            db.execute("UPDATE lines SET state = 'pending', claimed_by = NULL WHERE claimed_by = ? "
                       "AND state = 'claimed'", (self.runner_id,))
            db.execute("UPDATE batches SET claimed_by = NULL WHERE claimed_by = ?", (self.runner_id,))
            db.execute("UPDATE batches SET webhook_state = 'pending' WHERE webhook_state = ?",
                       (f"sending:{self.runner_id}",))
            db.execute("DELETE FROM runners WHERE id = ?", (self.runner_id,))

    def start_batches(self) -> None:
        """validating → in_progress (the lines were checked at creation)."""
        self.db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE status = 'validating'",
                        (_now(),))

    def expire_batches(self) -> None:
        """Batches past their completion window head for `expired`."""
        now = _now()
        self.db.execute("UPDATE batches SET status = 'finalizing', ending = 'expired', finalizing_at = ? "
                        "WHERE status IN ('validating', 'in_progress') AND expires_at <= ?", (now, now))

    def claim_lines(self, limit: int) -> list[dict]:
        """Up to `limit` pending lines of in-progress batches, oldest batch first."""
        if limit <= 0:
            return []
        with self.transaction() as db:
            rows = db.execute(
                "UPDATE lines SET state = 'claimed', claimed_by = ? WHERE rowid IN ("
                " SELECT lines.rowid FROM lines JOIN batches ON batches.id = lines.batch_id"
                " WHERE lines.state = 'pending' AND batches.status = 'in_progress'"
                " ORDER BY batches.created_at, batches.id, lines.line LIMIT ?)"
                " RETURNING batch_id, line, custom_id, body", (self.runner_id, limit)).fetchall()
        return [dict(r) for r in rows]

    def release_lines(self, keys: Iterable[tuple[str, int]]) -> None:
        """Hand claimed lines back unfinished (their batch is ending, or this runner stops)."""
        with self.transaction() as db:
            db.executemany("UPDATE lines SET state = 'pending', claimed_by = NULL WHERE batch_id = ? AND line = ? "
                           "AND claimed_by = ? AND state = 'claimed'",
                           [(batch_id, line, self.runner_id) for batch_id, line in keys])

    def finish_line(self, batch_id: str, line: int, ok: bool, result: str) -> bool:
        """Record a line's output (ok) or error line, if this runner still holds it."""
        with self.transaction() as db:
            changed = db.execute("UPDATE lines SET state = 'done', ok = ?, result = ?, claimed_by = NULL "
                                 "WHERE batch_id = ? AND line = ? AND claimed_by = ? AND state = 'claimed'",
                                 (int(ok), result, batch_id, line, self.runner_id)).rowcount
            if changed:
                db.execute(f"UPDATE batches SET {'completed' if ok else 'failed'} = "
                           f"{'completed' if ok else 'failed'} + 1 WHERE id = ?", (batch_id,))
        return bool(changed)

    # ------------------------------------------------------------------ finalizing
    def claim_finalize(self) -> dict | None:
        """One batch ready to finalize, claimed by this runner: an in-progress batch with
        every line done (→ finalizing), or one cancelling or finalizing with no line
        still claimed, that no live runner is finalizing."""
        now = _now()
        with self.transaction() as db:
            db.execute("UPDATE batches SET status = 'finalizing', ending = 'completed', finalizing_at = ? "
                       "WHERE status = 'in_progress' AND NOT EXISTS (SELECT 1 FROM lines WHERE batch_id = batches.id"
                       " AND state != 'done')", (now,))
            row = db.execute("SELECT id FROM batches WHERE status IN ('finalizing', 'cancelling') AND claimed_by IS NULL "
                             "AND NOT EXISTS (SELECT 1 FROM lines WHERE batch_id = batches.id AND state = 'claimed') "
                             "ORDER BY created_at LIMIT 1").fetchone()
            if row is None:
                return None
            db.execute("UPDATE batches SET claimed_by = ? WHERE id = ?", (self.runner_id, row["id"]))
        return self.get_batch(None, row["id"])

    def close_unfinished(self, batch_id: str, make_error) -> None:
        """Every line not done gets `make_error(custom_id)` as its error line (a cancelled or
        expired batch's unrun lines)."""
        with self.transaction() as db:
            rows = db.execute("SELECT line, custom_id FROM lines WHERE batch_id = ? AND state = 'pending'",
                              (batch_id,)).fetchall()
            db.executemany("UPDATE lines SET state = 'done', ok = 0, result = ? WHERE batch_id = ? AND line = ?",
                           [(make_error(r["custom_id"]), batch_id, r["line"]) for r in rows])
            db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), batch_id))

    def results(self, batch_id: str, ok: bool) -> list[str]:
        return [row[0] for row in self.db.execute(
            "SELECT result FROM lines WHERE batch_id = ? AND state = 'done' AND ok = ? ORDER BY line",
            (batch_id, int(ok)))]

    def end_batch(self, batch_id: str, status: str, output_file_id: str | None, error_file_id: str | None) -> dict:
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at",
                 "failed": "failed_at"}[status]
        self.db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, error_file_id = ?, "
                        f"claimed_by = NULL, webhook_state = CASE WHEN webhook_url IS NULL THEN NULL ELSE 'pending' END "
                        f"WHERE id = ? AND claimed_by = ?",
                        (status, _now(), output_file_id, error_file_id, batch_id, self.runner_id))
        return self.get_batch(None, batch_id)

    # ------------------------------------------------------------------ webhooks
    def claim_webhook(self) -> dict | None:
        with self.transaction() as db:
            row = db.execute("SELECT id FROM batches WHERE webhook_state = 'pending' ORDER BY created_at LIMIT 1"
                             ).fetchone()
            if row is None:
                return None
            db.execute("UPDATE batches SET webhook_state = ? WHERE id = ?", (f"sending:{self.runner_id}", row["id"]))
        return self.get_batch(None, row["id"])

    def webhook_done(self, batch_id: str, delivered: bool, attempts: int) -> None:
        self.db.execute("UPDATE batches SET webhook_state = ?, webhook_attempts = ? WHERE id = ?",
                        ("delivered" if delivered else "gave_up", attempts, batch_id))


def batch_object(row: dict) -> dict:
    """A batch row as OpenAI's Batch object."""
    errors = json.loads(row["errors"]) if row.get("errors") else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "errors": errors,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"], "failed_at": row["failed_at"],
        "expired_at": row["expired_at"], "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row.get("metadata") else None,
    }


def file_object(row: dict) -> dict:
    """A file row as OpenAI's File object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": row["expires_at"], "status_details": None}
