"""Where the gateway keeps what it hands out later: uploaded batch input files, batch
output and error files, and images asked for with `response_format="url"`.

- `LocalStore(directory)`: plain files (the default: `<state dir>/outputs`). Links to
  them are the gateway's own route `GET /outputs/{name}?expires=…&signature=…`, signed
  with an HMAC key of the state dir and valid for a limited time, so that a browser or
  an `<img>` tag can fetch an image without the API key, as S3's presigned links allow.
- `S3Store(bucket, prefix)`: any S3-compatible object store (`--output-store
  s3://bucket/prefix`, `--s3-endpoint-url` for MinIO, Ceph, moto…); links are S3's
  presigned GET URLs. boto3 is imported only here and only then (the `[s3]` extra);
  credentials come from boto3's own chain (AWS_ACCESS_KEY_ID…, ~/.aws, instance roles).

Names are the gateway's own (`files/<id>`, `images/<id>.png`), never a caller's text.
Every call is blocking I/O: the app runs them on a worker thread.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import pathlib
import re
import time
import urllib.parse

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127}){0,3}$")
LOCAL_LINK_PREFIX = "/outputs/"


def checked_name(name: str) -> str:
    """A store name the gateway made (no `..`, no absolute paths); ValueError otherwise."""
    if not _NAME.match(name) or ".." in name:
        raise ValueError(f"not a store name: {name!r}")
    return name


class LinkSigner:
    """Signs and checks the local store's expiring links (HMAC-SHA256 of name and expiry)."""

    def __init__(self, key: bytes):
        self.key = key

    def signature(self, name: str, expires: int) -> str:
        digest = hmac.new(self.key, f"{name}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def valid(self, name: str, expires: str, signature: str, now: float | None = None) -> bool:
        try:
            expiry = int(expires)
        except ValueError:
            return False
        if expiry < (time.time() if now is None else now):
            return False
        return hmac.compare_digest(self.signature(name, expiry), signature)


class LocalStore:
    kind = "local"

    def __init__(self, directory: str | os.PathLike, signer: LinkSigner):
        self.root = pathlib.Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.signer = signer

    def _path(self, name: str) -> pathlib.Path:
        return self.root / checked_name(name)

    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, path)  # readers never see half a file

    def get(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            raise KeyError(name) from None

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def link(self, name: str, ttl_s: float, base_url: str) -> str:
        """An expiring link to `name` on this gateway (`base_url`: its public root)."""
        expires = int(time.time() + ttl_s)
        query = urllib.parse.urlencode({"expires": expires, "signature": self.signer.signature(name, expires)})
        return f"{base_url.rstrip('/')}{LOCAL_LINK_PREFIX}{name}?{query}"

    def sweep(self, prefix: str, older_than_s: float) -> int:
        """Delete the objects under `prefix` older than `older_than_s`; how many."""
        cutoff, removed = time.time() - older_than_s, 0
        folder = self.root / checked_name(prefix.strip("/"))
        for path in folder.glob("*") if folder.is_dir() else ():
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed


class S3Store:
    kind = "s3"

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, client=None):
        if client is None:
            try:
                import boto3
            except ImportError:  # the [s3] extra is not installed
                raise RuntimeError("--output-store s3://… needs boto3: pip install 'diffslot[s3]'") from None
            from botocore.config import Config

            client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region,
                                  config=Config(signature_version="s3v4", retries={"max_attempts": 3}))
        self.client, self.bucket, self.prefix = client, bucket, prefix.strip("/")

    def _key(self, name: str) -> str:
        name = checked_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, ContentType=content_type)

    def get(self, name: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise KeyError(name) from None

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def link(self, name: str, ttl_s: float, base_url: str) -> str:
        return self.client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": self._key(name)},
                                                  ExpiresIn=max(1, int(ttl_s)))

    def sweep(self, prefix: str, older_than_s: float) -> int:
        """Nothing: expire objects with the bucket's own lifecycle rules (docs/operations.md)."""
        return 0


def open_store(location: str, signer: LinkSigner, *, endpoint_url: str | None = None, region: str | None = None):
    """`s3://bucket/prefix` → S3Store; anything else is a local directory."""
    if location.startswith("s3://"):
        bucket, _, prefix = location[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"--output-store {location!r}: expected s3://BUCKET[/PREFIX]")
        return S3Store(bucket, prefix, endpoint_url=endpoint_url, region=region)
    return LocalStore(location, signer)
