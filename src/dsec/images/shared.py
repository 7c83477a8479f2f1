"""The layer store shared by all nodes (DSEC_LAYER_STORE), as ImageService uses it.

    DSEC_LAYER_STORE=s3://bucket/prefix        endpoint/credentials: AWS_ENDPOINT_URL_S3, AWS_* ...
    DSEC_LAYER_STORE=file:///mnt/shared/dsec-store   a POSIX path mounted on every node

Publish (the node that builds or imports): each new layer's file, metadata pack and chunk
manifest go to the store (manifest last: it marks the layer complete; a layer already there
is not sent again), then the image record `images/<name>.json` with, per layer, the sha256
of its manifest. Fetch (a node that does not know a name): the record is read and checked
(its digest must be the sha256 of its layer digests), each layer's manifest is read and
checked against the pinned sha256 and written to the local store; the image is registered
locally. Bytes come later: through the lazy view, chunk by verified chunk (lazy.py,
lazyfs.py), or, with DSEC_LAZY=0, as whole layers checked against their digest.

Trust: the bytes of a layer are always checked against what its image record pins; the
record itself is what the store says the name means (like a registry tag), unless the name
is already known to this node.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from dsec.config import Paths
from dsec.types import DsecError, ImageInfo, InvalidArgument, LayerInfo, NotFound, Unavailable

from .layerstore import (RemoteLayerStore, StoreError, StoreMissing, image_key, image_name_of, layer_key,
                         open_store)
from .lazy import manifest_file, meta_file
from .store import TMP_PREFIX, check_digest, image_digest, layer_file

log = logging.getLogger("dsec.images")

ENV = "DSEC_LAYER_STORE"
RECORD_VERSION = 1


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class SharedStore:
    def __init__(self, url: str, paths: Paths, *, timeout_s: float = 10.0):
        try:
            self.store: RemoteLayerStore = open_store(url, timeout_s=timeout_s)
        except ValueError as e:
            raise InvalidArgument(f"bad layer store {e}", field=ENV,
                                  fix="set DSEC_LAYER_STORE=s3://BUCKET/PREFIX (endpoint and keys from "
                                      "AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or "
                                      "file:///PATH/ON/A/SHARED/MOUNT, or unset it") from None
        self.url = self.store.url
        self.paths = paths

    def _error(self, e: StoreError, doing: str) -> DsecError:
        if isinstance(e, StoreMissing):
            return NotFound(f"{doing}: {e.message}", field="layer", fix=e.fix)
        return Unavailable(f"{doing}: {e.message}", field=None, fix=e.fix)

    def check_reachable(self) -> None:
        """Unavailable naming the store and the fix if it does not answer."""
        try:
            self.store.has(".dsec-probe")
        except StoreError as e:
            raise self._error(e, "the shared layer store does not answer") from e

    # ---- publish ----------------------------------------------------------------------

    def publish_layer(self, digest: str, file: Path) -> str:
        """Send the layer at `file` (its manifest and metadata pack beside it) unless the store
        already has it with the same manifest. Returns the pin: sha256 of the manifest."""
        hexd = check_digest(digest).split(":", 1)[1]
        man_path = manifest_file(file)
        manifest = man_path.read_bytes()
        pin = sha256_bytes(manifest)
        man_key = layer_key(f"{hexd}.chunks.json")
        try:
            if self.store.has(man_key) and self.store.get_bytes(man_key) == manifest:
                return pin                                  # dedup: another build sent it
            if not self.store.has(layer_key(f"{hexd}.erofs")):
                if not file.is_file():
                    raise NotFound(f"layer {digest} is in neither this node's store nor {self.url}",
                                   field="layer", fix="rebuild the image that uses this layer")
                self.store.put_file(layer_key(f"{hexd}.erofs"), file)
            if meta_file(file).is_file():
                self.store.put_file(layer_key(f"{hexd}.meta"), meta_file(file))
            self.store.put_bytes(man_key, manifest)        # last: the layer is complete
        except StoreError as e:
            raise self._error(e, f"publishing layer {digest[:19]}") from e
        log.info("published layer %s to %s", digest[:19], self.url)
        return pin

    def publish_image(self, image: ImageInfo, pins: dict[str, str]) -> None:
        record = {"v": RECORD_VERSION, "name": image.name, "digest": image.digest,
                  "kind": image.kind, "owner": image.owner,
                  "layers": [{"digest": lay.digest, "size_bytes": lay.size_bytes,
                              "created_at": lay.created_at.isoformat(), "source": lay.source,
                              "chunks": pins[lay.digest]} for lay in image.layers]}
        try:
            self.store.put_bytes(image_key(image.name), json.dumps(record, indent=1).encode())
        except StoreError as e:
            raise self._error(e, f"image {image.name!r} is built on this node but publishing it") from e
        log.info("published image %s (%s) to %s", image.name, image.digest[:19], self.url)

    # ---- fetch ------------------------------------------------------------------------

    def fetch_record(self, name: str) -> tuple[dict[str, Any], list[LayerInfo], dict[str, str]] | None:
        """The store's record of image `name`, checked: (record, layers, digest -> pin);
        None if the store has no such image."""
        try:
            raw = self.store.get_bytes(image_key(name))
        except StoreMissing:
            return None
        except StoreError as e:
            raise self._error(e, f"looking up image {name!r}") from e
        bad = Unavailable(f"the record of image {name!r} in layer store {self.url} is corrupt or "
                          "does not match its digest; nothing was used from it", field=None,
                          fix="publish the image again from a node that has it (ImageService.publish)")
        try:
            rec = json.loads(raw)
            layers = [LayerInfo(digest=check_digest(lay["digest"]), size_bytes=int(lay["size_bytes"]),
                                created_at=datetime.fromisoformat(lay["created_at"]),
                                source=str(lay["source"])) for lay in rec["layers"]]
            pins = {lay["digest"]: str(lay["chunks"]) for lay in rec["layers"]}
            ok = (rec.get("v") == RECORD_VERSION and rec["name"] == name and layers
                  and rec["digest"] == image_digest([lay.digest for lay in layers])
                  and rec.get("kind", "image") in ("image", "layer"))
        except (ValueError, KeyError, TypeError, DsecError):
            ok = False
        if not ok:
            raise bad
        return rec, layers, pins

    def fetch_manifest(self, digest: str, pin: str) -> Path:
        """The layer's chunk manifest, checked against `pin`, written to the local store."""
        hexd = check_digest(digest).split(":", 1)[1]
        local = manifest_file(layer_file(self.paths, digest))
        try:
            data = self.store.get_bytes(layer_key(f"{hexd}.chunks.json"))
        except StoreError as e:
            raise self._error(e, f"fetching the chunk manifest of layer {digest[:19]}") from e
        if sha256_bytes(data) != pin:
            raise Unavailable(f"the chunk manifest of layer {digest} in layer store {self.url} does "
                              f"not match the sha256 its image record pins ({pin}); not used",
                              field=None, fix="the store object is corrupt or was replaced: publish "
                                              "the image again from a node that has it")
        _atomic_write(local, data)
        return local

    def pull_layer(self, digest: str) -> Path:
        """The whole layer file into the local store, checked against its digest (DSEC_LAZY=0)."""
        hexd = check_digest(digest).split(":", 1)[1]
        final = layer_file(self.paths, digest)
        tmp = final.with_name(f"{TMP_PREFIX}{secrets.token_hex(8)}.erofs")
        try:
            try:
                n = self.store.get_file(layer_key(f"{hexd}.erofs"), tmp)
            except StoreError as e:
                raise self._error(e, f"pulling layer {digest[:19]}") from e
            h = hashlib.sha256()
            with open(tmp, "rb") as f:
                while buf := f.read(8 << 20):
                    h.update(buf)
            if "sha256:" + h.hexdigest() != digest:
                raise Unavailable(f"layer {digest} in layer store {self.url} does not match its "
                                  "digest; not used", field=None,
                                  fix="the store object is corrupt or was replaced: publish the "
                                      "image again from a node that has it")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        log.info("pulled layer %s from %s (%d bytes)", digest[:19], self.url, n)
        return final

    def unpublish(self, name: str) -> list[str]:
        """Delete image `name`'s record, then the objects of its layers that no other record
        names (a parent's layers stay with the image that brought them). Returns the layer
        digests deleted. Nodes that pulled a layer whole keep their copy; a node reading one
        lazily needs the objects: the caller deletes only what no node uses (D82's exports).
        A publish of the same layer racing this delete is not excluded (no store-wide lock)."""
        got = self.fetch_record(name)
        if got is None:
            return []
        _, layers, _ = got
        try:
            self.store.delete(image_key(name))       # first: no node can fetch it any more
        except StoreError as e:
            raise self._error(e, f"deleting image {name!r}") from e
        named: set[str] = set()
        for other in self.image_names():
            try:
                rec = self.fetch_record(other)
            except DsecError:             # a corrupt record: keep what it may name
                return []
            if rec is not None:
                named |= {lay.digest for lay in rec[1]}
        dead = [lay.digest for lay in layers if lay.digest not in named]
        for d in dead:
            hexd = d.split(":", 1)[1]
            try:               # manifest first: without it the layer reads as incomplete
                for suffix in ("chunks.json", "meta", "erofs"):
                    self.store.delete(layer_key(f"{hexd}.{suffix}"))
            except StoreError as e:
                raise self._error(e, f"deleting layer {d[:19]} of image {name!r}") from e
        log.info("unpublished image %s from %s (%d layers deleted)", name, self.url, len(dead))
        return dead

    def image_names(self) -> list[str]:
        try:
            keys = self.store.list("images/")
        except StoreError as e:
            raise self._error(e, "listing images") from e
        return [n for k in keys if (n := image_name_of(k)) is not None]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{secrets.token_hex(6)}-{path.name}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

