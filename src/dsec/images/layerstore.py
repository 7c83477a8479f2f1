"""Remote layer stores shared by all nodes: S3-compatible object storage and a shared POSIX path.

Stdlib + botocore only and no dsec imports: the lazy view's daemon (lazyfs.py, run by
Debian's python3 with python3-botocore) imports this file as a sibling, and dsec imports it
as dsec.images.layerstore. Errors are StoreError (an OSError, so lazyfs turns a failed
fetch into EIO); dsec.images.shared maps them to dsec.types errors.

    open_store("s3://bucket/some/prefix")     # endpoint + credentials: standard AWS env vars
    open_store("file:///mnt/shared/dsec-store")   # NFS, CephFS, 3FS, ... mounted on every node

Keys (relative to the store's root/prefix):
    layers/<hex>.erofs         the layer file, named by the sha256 of its bytes
    layers/<hex>.meta          its EROFS metadata pack (lazy.py)
    layers/<hex>.chunks.json   its chunk manifest; written last: its presence marks the layer complete
    images/<quoted name>.json  image records: name -> ordered layers (+ each manifest's sha256)

Nothing read from a store is trusted: layer bytes are checked against the chunk manifest,
the manifest against the sha256 pinned in the image record, the record against the image
digest (sha256 of its layer digests), whole layers against their digest.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
import urllib.parse
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any, Callable

PART_BYTES = 64 << 20          # multipart upload part size (S3 allows 5 MiB..5 GiB, 10,000 parts)


class StoreError(OSError):
    """The store failed or refused (unreachable, denied, timed out). `fix` says what to do."""

    def __init__(self, message: str, fix: str, err: int = errno.EIO):
        super().__init__(err, message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message


class StoreMissing(StoreError):
    """The key is not in the store."""

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix, errno.ENOENT)


def layer_key(name: str) -> str:
    """'<hex>.erofs' | '<hex>.meta' | '<hex>.chunks.json' -> its key."""
    return f"layers/{name}"


def image_key(name: str) -> str:
    return "images/" + urllib.parse.quote(name, safe="") + ".json"


def image_name_of(key: str) -> str | None:
    if not (key.startswith("images/") and key.endswith(".json")):
        return None
    return urllib.parse.unquote(key[len("images/"):-len(".json")])


class RemoteLayerStore(ABC):
    """A key -> bytes store every node of a cluster reaches. Writes are whole-object and atomic
    (a reader sees the old object, the new one or none, never a part); reads may be ranges."""

    url: str

    @abstractmethod
    def has(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes; StoreMissing if absent."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) (fewer at the end of the object)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> int:
        """Download the whole object to `dest` (written in place; callers rename). Bytes written."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def _missing(self, key: str) -> StoreMissing:
        return StoreMissing(f"{key} is not in the layer store {self.url}",
                            fix="publish it from the node that built it (ImageService.publish), "
                                "or check DSEC_LAYER_STORE names the same store on every node")


class PosixLayerStore(RemoteLayerStore):
    """A directory on a filesystem every node mounts (NFS, CephFS, 3FS, ...). Atomic writes:
    a temp file in the same directory, fsync, rename."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = "file://" + str(self.root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad key {key!r}")
        return self.root / key

    def _fail(self, what: str, e: OSError) -> StoreError:
        if e.errno == errno.ENOENT:
            return self._missing(what)
        return StoreError(f"layer store {self.url}: {what}: {e.strerror or e}",
                          fix=f"check that {self.root} is mounted and writable on this node "
                              "(the shared filesystem), or unset DSEC_LAYER_STORE", err=e.errno or errno.EIO)

    def has(self, key: str) -> bool:
        try:
            return self._path(key).is_file()
        except OSError as e:
            raise self._fail(key, e) from e

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except OSError as e:
            raise self._fail(key, e) from e

    def _atomic_write(self, key: str, write: Callable[[IO[bytes]], Any]) -> None:
        final = self._path(key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(f".tmp-{secrets.token_hex(6)}-{final.name}")
            try:
                with open(tmp, "xb") as f:
                    write(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as e:
            raise self._fail(key, e) from e

    def put_file(self, key: str, path: Path) -> None:
        def write(f: IO[bytes]) -> None:
            with open(path, "rb") as src:
                while buf := src.read(8 << 20):
                    f.write(buf)
        self._atomic_write(key, write)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda f: f.write(data))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.pread(fd, length, offset)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._fail(key, e) from e

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as e:
            raise self._fail(key, e) from e

    def get_file(self, key: str, dest: Path) -> int:
        n = 0
        try:
            with open(self._path(key), "rb") as src, open(dest, "wb") as out:
                while buf := src.read(8 << 20):
                    out.write(buf)
                    n += len(buf)
        except OSError as e:
            raise self._fail(key, e) from e
        return n

    def list(self, prefix: str) -> list[str]:
        d, _, stem = prefix.rpartition("/")
        base = self._path(d) if d else self.root
        try:
            names = os.listdir(base)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._fail(prefix, e) from e
        return sorted(f"{d}/{n}" if d else n for n in names
                      if n.startswith(stem) and not n.startswith(".tmp-"))

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise self._fail(key, e) from e


class S3LayerStore(RemoteLayerStore):
    """An S3 bucket (AWS S3, MinIO, Ceph RGW, SeaweedFS, ...) through botocore. Endpoint:
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (unset: AWS); credentials and region: botocore's
    usual chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance roles, ...).
    A custom endpoint gets path-style addressing, which every S3 clone serves."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 region: str | None = None, timeout_s: float = 10.0, attempts: int = 3):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        env = os.environ
        self.endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
        self.region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"{self.url} (endpoint {self.endpoint or 'AWS'})"

    def client(self) -> Any:
        """The botocore S3 client (created on first use; thread-safe)."""
        with self._lock:
            if self._client is None:
                try:
                    import botocore.session
                    from botocore.config import Config
                except ImportError as e:
                    raise StoreError(f"layer store {self.url} needs botocore, which this Python lacks",
                                     fix="pip install 'dsec-sandbox[s3]' (the server) and apt-get install "
                                         "python3-botocore (the lazy view's daemon)") from e
                cfg = Config(connect_timeout=min(5.0, self.timeout_s), read_timeout=self.timeout_s,
                             retries={"max_attempts": self.attempts, "mode": "standard"},
                             s3={"addressing_style": "path" if self.endpoint else "auto"},
                             max_pool_connections=32)
                self._client = botocore.session.get_session().create_client(
                    "s3", endpoint_url=self.endpoint, region_name=self.region, config=cfg)
            return self._client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, what: str, e: Exception) -> StoreError:
        code, status = "", None
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            code = str(resp.get("Error", {}).get("Code", ""))
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code != "NoSuchBucket" and (code in ("NoSuchKey", "404", "NotFound") or status == 404):
            return self._missing(what)
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            fix = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) "
                   f"may read and write bucket {self.bucket!r}")
        elif code == "NoSuchBucket":
            fix = f"create bucket {self.bucket!r} on {self.endpoint or 'AWS'}, or fix DSEC_LAYER_STORE"
        else:
            fix = (f"check the S3 endpoint {self.endpoint or 'AWS'} is up and reachable from this node "
                   "(AWS_ENDPOINT_URL_S3), or unset DSEC_LAYER_STORE to use node-local layers only")
        return StoreError(f"layer store {self.where}: {what}: {type(e).__name__}: {e}", fix=fix)

    def has(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except StoreMissing:
            return False

    def size(self, key: str) -> int:
        try:
            r = self.client().head_object(Bucket=self.bucket, Key=self._key(key))
        except StoreError:
            raise
        except Exception as e:
            raise self._fail(key, e) from e
        return int(r["ContentLength"])

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client().put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except StoreError:
            raise
        except Exception as e:
            raise self._fail(key, e) from e

    def put_file(self, key: str, path: Path) -> None:
        size = os.stat(path).st_size
        c = self.client()
        k = self._key(key)
        try:
            if size <= PART_BYTES:
                with open(path, "rb") as f:
                    c.put_object(Bucket=self.bucket, Key=k, Body=f)
                return
            # multipart: the object appears only at complete, so readers never see a part
            up = c.create_multipart_upload(Bucket=self.bucket, Key=k)["UploadId"]
            try:
                parts = []
                with open(path, "rb") as f:
                    n = 1
                    while buf := f.read(PART_BYTES):
                        r = c.upload_part(Bucket=self.bucket, Key=k, UploadId=up, PartNumber=n, Body=buf)
                        parts.append({"ETag": r["ETag"], "PartNumber": n})
                        n += 1
                c.complete_multipart_upload(Bucket=self.bucket, Key=k, UploadId=up,
                                            MultipartUpload={"Parts": parts})
            except BaseException:
                try:
                    c.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=up)
                except Exception:
                    pass
                raise
        except StoreError:
            raise
        except Exception as e:
            raise self._fail(key, e) from e

    def _get(self, key: str, rng: str | None) -> Any:
        kw = {"Range": rng} if rng else {}
        try:
            return self.client().get_object(Bucket=self.bucket, Key=self._key(key), **kw)["Body"]
        except StoreError:
            raise
        except Exception as e:
            raise self._fail(key, e) from e

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return self._read(key, f"bytes={offset}-{offset + length - 1}")

    def get_bytes(self, key: str) -> bytes:
        return self._read(key, None)

    def _read(self, key: str, byte_range: str | None) -> bytes:
        body = self._get(key, byte_range)
        try:
            data: bytes = body.read()
            return data
        except Exception as e:
            raise self._fail(key, e) from e
        finally:
            body.close()

    def get_file(self, key: str, dest: Path) -> int:
        body = self._get(key, None)
        n = 0
        try:
            with open(dest, "wb") as out:
                for buf in body.iter_chunks(8 << 20):
                    out.write(buf)
                    n += len(buf)
        except OSError:
            raise
        except Exception as e:
            raise self._fail(key, e) from e
        finally:
            body.close()
        return n

    def list(self, prefix: str) -> list[str]:
        out: list[str] = []
        strip = len(self._key(""))
        try:
            pages = self.client().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                out += [o["Key"][strip:] for o in page.get("Contents", [])]
        except StoreError:
            raise
        except Exception as e:
            raise self._fail(prefix, e) from e
        return sorted(out)

    def delete(self, key: str) -> None:
        try:
            self.client().delete_object(Bucket=self.bucket, Key=self._key(key))
        except StoreError:
            raise
        except Exception as e:
            raise self._fail(key, e) from e


def open_store(url: str, *, timeout_s: float = 10.0) -> RemoteLayerStore:
    """'s3://BUCKET[/PREFIX]' or 'file:///ABS/PATH' (or '/ABS/PATH'). ValueError if neither."""
    u = urllib.parse.urlsplit(url)
    if u.scheme == "s3":
        if not u.netloc or u.query or u.fragment:
            raise ValueError(f"{url!r}: expected s3://BUCKET[/PREFIX]")
        return S3LayerStore(u.netloc, u.path, timeout_s=timeout_s)
    if u.scheme == "file" or (not u.scheme and url.startswith("/")):
        path = u.path if u.scheme else url
        if u.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ValueError(f"{url!r}: expected file:///ABSOLUTE/PATH")
        return PosixLayerStore(path.rstrip("/") or "/")
    raise ValueError(f"{url!r}: expected s3://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH")
