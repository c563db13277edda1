"""Where finished recordings go: a local directory or an S3-compatible bucket.

Every method blocks (file system, boto3) and runs on the recordings' worker threads, never on
the event loop. A recording's *location* is what the call record keeps: ``local:KEY`` or
``s3://BUCKET/KEY``; a sink only opens locations of its own, and keys are checked, so a stored
location cannot name a file outside the sink.

    RecordingError           the sink failed (disk full, not writable, bucket unreachable...)
    └── RecordingNotFound    no such recording in this sink (expired, or never saved here)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ivr.errors import IvrError

CHUNK_BYTES = 64 * 1024
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*(/[A-Za-z0-9][A-Za-z0-9_\-.]*)*")
S3_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys


class RecordingError(IvrError):
    """A recording sink failed; ``reason`` is a short label for logs and metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"recording sink failed ({reason}): {detail}")
        self.reason = reason


class RecordingNotFound(RecordingError):
    def __init__(self, location: str) -> None:
        super().__init__("not_found", f"no recording at {location!r}")


@dataclass(frozen=True, slots=True)
class RecordingBody:
    """A stored recording being read: its size and its bytes, a chunk at a time."""

    size: int
    chunks: Iterator[bytes]


class RecordingSink(Protocol):
    """Stores, reads and expires recordings. Blocking: call from a worker thread."""

    kind: str
    """``local`` or ``s3``: the label in logs."""

    def save(self, source: Path, key: str) -> str:
        """Store the file at ``source`` under ``key``; returns its location."""
        ...

    def open(self, location: str) -> RecordingBody:
        """Read a recording this sink saved; RecordingNotFound if it is not here."""
        ...

    def delete_older_than(self, cutoff: float) -> int:
        """Delete recordings saved before ``cutoff`` (epoch seconds); returns how many."""
        ...


def checked_key(key: str) -> str:
    """``key`` if it is a plain relative path of safe names (no ``..``, no absolute path)."""
    if not _KEY.fullmatch(key) or ".." in key:
        raise RecordingNotFound(key)
    return key


class LocalDirSink:
    """Recordings as files under a directory (created when needed, written atomically)."""

    kind = "local"
    PREFIX = "local:"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def save(self, source: Path, key: str) -> str:
        target = self.root / checked_key(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # Copy next to the target, then rename: a reader never sees half a file.
            fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".partial-")
            try:
                with os.fdopen(fd, "wb") as out, source.open("rb") as src:
                    shutil.copyfileobj(src, out, CHUNK_BYTES)
                os.replace(partial, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
                raise
        except OSError as exc:
            raise RecordingError(_os_reason(exc), f"{target}: {exc}") from exc
        return self.PREFIX + key

    def open(self, location: str) -> RecordingBody:
        if not location.startswith(self.PREFIX):
            raise RecordingNotFound(location)
        path = self.root / checked_key(location.removeprefix(self.PREFIX))
        try:
            handle = path.open("rb")
        except FileNotFoundError as exc:
            raise RecordingNotFound(location) from exc
        except OSError as exc:
            raise RecordingError(_os_reason(exc), f"{path}: {exc}") from exc
        return RecordingBody(os.fstat(handle.fileno()).st_size, _read_chunks(handle))

    def delete_older_than(self, cutoff: float) -> int:
        deleted = 0
        if not self.root.is_dir():
            return 0
        for path in sorted(self.root.rglob("*"), reverse=True):  # files before their folders
            try:
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    deleted += not path.name.startswith(".partial-")
                elif path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
            except OSError:
                continue  # raced with a writer or another instance's sweep: next time
        return deleted


def _read_chunks(handle: Any) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


def _os_reason(exc: OSError) -> str:
    names = {
        errno.ENOSPC: "disk_full",
        errno.EDQUOT: "disk_full",
        errno.EACCES: "not_writable",
        errno.EPERM: "not_writable",
        errno.EROFS: "not_writable",
        errno.ENOTDIR: "not_a_directory",
        errno.EEXIST: "not_a_directory",
    }
    return names.get(exc.errno or 0, "os_error")


@dataclass(frozen=True, slots=True)
class S3Config:
    bucket: str
    prefix: str = "recordings/"
    endpoint_url: str | None = None
    """An S3-compatible server (MinIO, Ceph, R2...); None: AWS."""
    region: str = "us-east-1"
    connect_timeout: float = 3.0
    read_timeout: float = 10.0
    attempts: int = 3


class S3Sink:
    """Recordings as objects in an S3-compatible bucket, through boto3.

    Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``, a profile, an instance role). Timeouts and attempts are bounded,
    so an unreachable bucket costs a worker thread seconds, not forever.
    """

    kind = "s3"

    def __init__(self, config: S3Config) -> None:
        import boto3
        from botocore.config import Config

        self.config = config
        self.prefix = config.prefix.strip("/") + "/" if config.prefix.strip("/") else ""
        self._client: Any = boto3.client(
            "s3",
            endpoint_url=config.endpoint_url or None,
            region_name=config.region,
            config=Config(
                connect_timeout=config.connect_timeout,
                read_timeout=config.read_timeout,
                retries={"max_attempts": config.attempts, "mode": "standard"},
            ),
        )

    def _location(self, key: str) -> str:
        return f"s3://{self.config.bucket}/{self.prefix}{key}"

    def save(self, source: Path, key: str) -> str:
        object_key = self.prefix + checked_key(key)
        try:
            with source.open("rb") as body:
                self._client.put_object(Bucket=self.config.bucket, Key=object_key, Body=body)
        except Exception as exc:  # botocore's tree: ClientError, EndpointConnectionError, ...
            raise RecordingError(_s3_reason(exc), f"s3://{self.config.bucket}: {exc}") from exc
        return self._location(key)

    def open(self, location: str) -> RecordingBody:
        head = f"s3://{self.config.bucket}/{self.prefix}"
        if not location.startswith(head):
            raise RecordingNotFound(location)
        object_key = self.prefix + checked_key(location.removeprefix(head))
        try:
            answer = self._client.get_object(Bucket=self.config.bucket, Key=object_key)
        except Exception as exc:
            if _s3_reason(exc) == "not_found":
                raise RecordingNotFound(location) from exc
            raise RecordingError(_s3_reason(exc), f"{location}: {exc}") from exc
        body = answer["Body"]
        return RecordingBody(int(answer["ContentLength"]), _s3_chunks(body))

    def delete_older_than(self, cutoff: float) -> int:
        old: list[dict[str, str]] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket, Prefix=self.prefix
            )
            for page in pages:
                for item in page.get("Contents", []):
                    if item["LastModified"].timestamp() < cutoff:
                        old.append({"Key": item["Key"]})
            for start in range(0, len(old), S3_DELETE_BATCH):
                batch = old[start : start + S3_DELETE_BATCH]
                self._client.delete_objects(
                    Bucket=self.config.bucket, Delete={"Objects": batch, "Quiet": True}
                )
        except Exception as exc:
            raise RecordingError(_s3_reason(exc), f"s3://{self.config.bucket}: {exc}") from exc
        return len(old)


def _s3_chunks(body: Any) -> Iterator[bytes]:
    try:
        yield from body.iter_chunks(CHUNK_BYTES)
    finally:
        body.close()


def _s3_reason(exc: Exception) -> str:
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        HTTPClientError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            return "not_found"
        if code == "NoSuchBucket":
            return "no_bucket"
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            return "access_denied"
        return "s3_error"
    if isinstance(exc, ReadTimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionError | HTTPClientError):  # refused, reset, DNS
        return "unreachable"
    return "s3_error"
