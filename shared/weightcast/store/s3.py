"""The object-store transport: versions in an S3-compatible bucket, for nodes on any host.

The store's root is ``s3://bucket/prefix``; version ``v17`` is the objects under
``prefix/v17/``, one per file, so the registry's ``path`` means the same as in a directory.

* The publisher uploads a version it has written locally (:class:`S3VersionWrite`): its
  weights files part by part as the writer writes them, then the rest
  (:meth:`S3Store.upload_version`), each file as a multipart upload of :data:`PART_BYTES`
  parts sent in parallel, at most ``concurrency`` parts in memory, the manifest last. It
  registers the version only after that returns, so a node never finds a partial one; what
  a kill leaves (objects of an unregistered version, unfinished multipart uploads) is removed
  at the next start.
* A node reads only the byte ranges it needs (:meth:`S3Object.read_into`): ranged GETs of at
  most :data:`PART_BYTES`, in parallel, each streamed straight into its destination, with
  ``If-Match`` on the ETag seen when the file was opened, so an object replaced mid-read is
  refused rather than mixed.

Every call goes through :meth:`S3Store.call`: throttling, 5xx answers and lost connections
are retried with capped exponential back-off (:class:`~weightcast.runtime.retry.Retries`) for
``retry_seconds``, then raise :class:`StoreUnavailable`; a refused credential, a missing
bucket or a 403 raises :class:`StoreAccessDenied` at once (:mod:`weightcast.store.s3_replies`).

The endpoint's answers are trusted no more than the objects (:class:`BoundedSession`): every
request must end within ``retry_seconds`` (:data:`REQUEST_SECONDS` at least; a connection
still answering then is shut down, one silent before its headers is given up),
a body botocore parses (an error, a listing) is read up to a cap, and a size that is missing,
negative, no number or not what was asked for, an answer cut short, or a listing that goes
round in circles is an :class:`~weightcast.store.s3_replies.UnusableReply`: retried like a
lost connection.
Credentials come from boto3's standard chain (environment, profile, instance role) and never
appear in a log, a message or Redis.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Self, TypeVar
from urllib.parse import parse_qsl, urlsplit
from xml.etree.ElementTree import ParseError, XMLPullParser

import boto3
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.config import Config as BotoConfig
from urllib3 import BaseHTTPResponse

from weightcast.contract.errors import (
    ConfigError,
    ObjectMissing,
    StoreAccessDenied,
    StoreUnavailable,
    WeightcastError,
    WeightsError,
)
from weightcast.contract.manifest import MANIFEST_NAME
from weightcast.contract.version_info import dir_version
from weightcast.runtime.logs import get_logger
from weightcast.runtime.retry import Retries
from weightcast.store.base import Identity, WritableStore
from weightcast.store.directory import plain_name
from weightcast.store.s3_replies import UnusableReply, store_error

T = TypeVar("T")
log = get_logger("store")

PART_BYTES = 16 * 1024 * 1024
"""Bytes per multipart part and per ranged GET at most."""
READ_PIECE_BYTES = 1024 * 1024
"""Bytes a GET's answer is read in at a time: urllib3's ``readinto`` reads into a new bytes
object as large as the view it is given, then copies it."""
UPLOAD_SLOTS = 6
"""Parts of one object a writer may have in flight as it writes (a copy each: 96 MiB)."""
REPLY_BYTES = 4 * 1024 * 1024
"""The longest body botocore parses that is not an error (a listing of 1,000 keys: ~1.5 MB)."""
ERROR_BYTES = 64 * 1024
"""The longest error body read (S3's are under 1 KiB); a longer one is dropped unread and the
answer's HTTP status says what it was."""
XML_DEPTH = 32
"""The deepest nesting of a parsed body (S3's: 4); a deeper one never reaches the parser."""
REQUEST_SECONDS = 10.0
"""How long a request may take at least, whatever ``retry_seconds`` (a 16 MiB part's upload)."""
LIST_PAGES = 100_000
"""Pages of one listing at most (100 million keys): a listing that never ends is refused."""
ADDRESSING_STYLES = ("auto", "path", "virtual")
URL_OPTIONS = ("endpoint_url", "region", "addressing_style")


@dataclass(frozen=True)
class S3Location:
    """An ``s3://bucket/prefix`` URL, with the options an S3-compatible server needs as query
    parameters (``?endpoint_url=http://host:port&region=...&addressing_style=path``), so one
    string names the store for every process of a node. Never credentials."""

    bucket: str
    prefix: str
    endpoint_url: str = ""
    region: str = ""
    addressing_style: str = "auto"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.hostname:
            raise ConfigError(f"{url!r} is not an s3://bucket/prefix URL")
        if parts.username or parts.password or "@" in parts.netloc:
            raise ConfigError(
                "the weights URL carries credentials; give them through the AWS environment "
                "or profile (AWS_ACCESS_KEY_ID, AWS_PROFILE), never in the URL"
            )
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(options) - set(URL_OPTIONS))
        if unknown:
            raise ConfigError(
                f"the weights URL has unknown options {unknown}; it takes {list(URL_OPTIONS)}"
            )
        style = options.get("addressing_style") or "auto"
        if style not in ADDRESSING_STYLES:
            raise ConfigError(f"addressing_style {style!r}: use one of {list(ADDRESSING_STYLES)}")
        prefix = parts.path.strip("/")
        for part in prefix.split("/") if prefix else ():
            if part in ("", ".", ".."):
                raise ConfigError(f"the weights URL's prefix {parts.path!r} is not plain names")
        return cls(
            parts.netloc,
            f"{prefix}/" if prefix else "",
            options.get("endpoint_url", ""),
            options.get("region", ""),
            style,
        )

    @property
    def label(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


class S3Store(WritableStore):
    """Versions in ``s3://bucket/prefix`` (see the module doc)."""

    def __init__(self, location: S3Location, concurrency: int = 16, retry_seconds: float = 60.0):
        self.location = location
        self.label = location.label
        self.bucket = location.bucket
        self.prefix = location.prefix
        self.retry_seconds = retry_seconds
        self.request_seconds = max(retry_seconds, REQUEST_SECONDS)
        """How long one request may take, its answer's body read (:data:`DEADLINE`)."""
        self.concurrency = concurrency
        config = BotoConfig(
            retries={"total_max_attempts": 1},  # retried here, with the project's back-off
            max_pool_connections=concurrency + 4,
            connect_timeout=5,
            read_timeout=min(60.0, self.request_seconds),  # a stall before the headers
            s3={"addressing_style": location.addressing_style},
        )
        session = boto3.session.Session()
        self.client: Any = session.client(
            "s3",
            endpoint_url=location.endpoint_url or None,
            region_name=location.region or None,
            config=config,
        )
        endpoint = self.client._endpoint  # botocore's only hook between socket and parser
        endpoint.http_session = BoundedSession(endpoint.http_session)
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="weightcast-s3")
        self.upload_slots = UPLOAD_SLOTS

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried through an outage of the store (see the module doc); each try
        ends within ``request_seconds`` (:data:`DEADLINE`)."""
        retries = Retries(0.2, 5.0, self.retry_seconds, since=time.monotonic())
        while True:
            try:
                DEADLINE.at = time.monotonic() + self.request_seconds
                return fn()
            except Exception as exc:
                if isinstance(exc, WeightcastError) and not isinstance(exc, UnusableReply):
                    raise  # already typed: a refusal, or the version's own fault
                error = store_error(exc, f"{self.label}: {what}")
                if error is None:
                    raise
                if not isinstance(error, StoreUnavailable):
                    raise error from None
                pause = retries.failed()
                if retries.spent:
                    raise error from None
                log.warning(
                    "object store unavailable; retrying", what=what, retry_in=round(pause, 2)
                )
                time.sleep(pause)
            finally:
                DEADLINE.at = NO_DEADLINE  # no deadline for a request made outside a call

    def key(self, *names: str) -> str:
        return self.prefix + "/".join(names)

    def check(self) -> None:
        try:
            self.call("checking the bucket", partial(self.client.head_bucket, Bucket=self.bucket))
        except ObjectMissing:  # a HEAD's 404 has no code: the bucket is not there
            raise StoreAccessDenied(
                f"{self.label}: no such bucket; create it, or check the bucket name and the "
                "endpoint (s3_endpoint_url)"
            ) from None

    # Nodes

    def open_version(self, path: str) -> S3Version:
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise WeightsError(
                f"registered path {path!r} is not plain names below {self.label}; "
                "refusing to read it"
            )
        return S3Version(self, parts)

    # The publisher

    def begin_version(self, name: str) -> S3VersionWrite:
        return S3VersionWrite(self, name)

    def upload_version(self, name: str, local: Path, uploaded: Collection[str] = ()) -> int:
        """Make the complete local version directory ``local`` the store's version ``name``:
        its files but those ``uploaded`` already (:meth:`open_upload`), ``manifest.json``
        last; how many files it sent."""
        plain_name(name, "version directory")
        files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
        files.sort(key=lambda p: p == Path(MANIFEST_NAME))  # last: the version is complete
        sent = 0
        for file in files:
            if file.as_posix() not in uploaded:
                self.upload_file(local / file, self.key(name, *_plain_parts(file.as_posix())))
                sent += 1
        return sent

    def open_upload(self, name: str, file: str) -> MultipartUpload:
        """Start sending ``file`` of version ``name`` as it is written."""
        plain_name(name, "version directory")
        return MultipartUpload(self, self.key(name, *_plain_parts(file)), self.upload_slots)

    def upload_file(self, path: Path, key: str) -> None:
        """One local file as the object ``key``: a plain PUT when it fits one part, else a
        :class:`MultipartUpload` of its parts."""
        size = path.stat().st_size
        with open(path, "rb", buffering=0) as f:
            if size <= PART_BYTES:
                body = f.read()
                self.call(
                    f"uploading {key}",
                    partial(self.client.put_object, Bucket=self.bucket, Key=key, Body=body),
                )
                return
            upload = MultipartUpload(self, key, self.concurrency)
            try:
                for number, offset in enumerate(range(0, size, PART_BYTES), start=1):
                    upload.part(number, os.pread(f.fileno(), PART_BYTES, offset))
                upload.complete()
            except BaseException:
                upload.abort()
                raise

    def remove_version(self, name: str) -> None:
        prefix = self.key(plain_name(name, "version directory"), "")
        self._delete(self._keys(prefix), prefix)

    def _delete(self, keys: Iterable[str], prefix: str) -> None:
        for batch in _batches(keys, 1000):
            objects = {"Objects": [{"Key": k} for k in batch], "Quiet": True}
            self.call(
                f"removing objects under {prefix}",
                partial(self.client.delete_objects, Bucket=self.bucket, Delete=objects),
            )

    def trim_version(self, name: str, keep: Collection[str]) -> None:
        prefix = self.key(plain_name(name, "version directory"), "")
        extra = [k for k in self._keys(prefix) if k[len(prefix) :] not in keep]
        self._delete(extra, prefix)

    def version_names(self) -> list[str]:
        # From the keys, not from a delimited listing: some servers (SeaweedFS) list a
        # folder whose objects were all deleted as a common prefix still.
        names = {key[len(self.prefix) :].split("/", 1)[0] for key in self._keys(self.prefix)}
        return sorted(name for name in names if dir_version(name) is not None)

    def remove_unfinished(self) -> list[str]:
        removed = 0
        page = self.call(
            "listing unfinished uploads",
            partial(self.client.list_multipart_uploads, Bucket=self.bucket, Prefix=self.prefix),
        )
        for upload in page.get("Uploads", []):
            self.call(
                "aborting an unfinished upload",
                partial(
                    self.client.abort_multipart_upload,
                    Bucket=self.bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                ),
            )
            removed += 1
        return [f"{removed} unfinished uploads"] if removed else []

    def _keys(self, prefix: str) -> Iterator[str]:
        token = ""
        for _ in range(LIST_PAGES):
            page = self.call(f"listing {prefix}", partial(self._list_page, prefix, token))
            yield from (item["Key"] for item in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]
        raise StoreUnavailable(f"{self.label}: listing {prefix}: more than {LIST_PAGES} pages")

    def _list_page(self, prefix: str, token: str) -> dict[str, Any]:
        """One page of the keys under ``prefix``, after ``token``; a truncated page must say
        where the next one starts, elsewhere than this one."""
        more = {"ContinuationToken": token} if token else {}
        page: dict[str, Any] = self.client.list_objects_v2(
            Bucket=self.bucket, Prefix=prefix, **more
        )
        if page.get("IsTruncated") and page.get("NextContinuationToken", token) == token:
            raise UnusableReply("a truncated listing names no next page")
        return page


class S3VersionWrite:
    """A version on its way into the bucket: its weights files sent part by part as the
    publisher's writer writes them (no second pass over their bytes), the rest uploaded from
    the written directory at :meth:`finish`."""

    def __init__(self, store: S3Store, name: str) -> None:
        self.store = store
        self.name = plain_name(name, "version directory")
        self.uploads: dict[str, MultipartUpload] = {}

    @property
    def sent(self) -> set[str]:
        """The files in the bucket already: sent as they were written."""
        return {file for file, upload in self.uploads.items() if upload.completed}

    def file(self, name: str) -> MultipartUpload:
        upload = self.uploads[name] = self.store.open_upload(self.name, name)
        return upload

    def finish(self, local: Path) -> int:
        return self.store.upload_version(self.name, local, self.sent)

    def abort(self) -> None:
        """Give the unfinished uploads up and remove what was sent (best effort: what remains
        is removed at the next start); nothing to do before the first file (a snapshot the
        converter refused before writing: the bucket is not called)."""
        if not self.uploads:
            return
        for upload in self.uploads.values():
            if not upload.completed:
                upload.abort()
        with contextlib.suppress(WeightcastError):
            self.store.remove_version(self.name)


class MultipartUpload:
    """One object sent in parts as its bytes come (from a file, or from the publisher's writer
    as it writes them): each part goes out on the store's pool at once, at most ``slots``
    parts in flight (a part beyond that waits: memory stays bounded), and the object exists
    only once :meth:`complete` succeeds. Parts may come in any order."""

    def __init__(self, store: S3Store, key: str, slots: int) -> None:
        self.store = store
        self.key = key
        self.slots = threading.BoundedSemaphore(slots)
        self.sent: list[Future[dict[str, object]]] = []
        answer = store.call(
            f"starting the upload of {key}",
            partial(store.client.create_multipart_upload, Bucket=store.bucket, Key=key),
        )
        self.upload_id = str(answer["UploadId"])
        self.completed = False

    def part(self, number: int, data: bytes | memoryview) -> None:
        """Send part ``number`` (1-based; every part but the last at least 5 MiB, S3's rule);
        ``data`` is copied first when the caller reuses its buffer (a memoryview)."""
        body = data if isinstance(data, bytes) else bytes(data)
        self.slots.acquire()
        for done in [f for f in self.sent if f.done()]:
            done.result()  # a failed part fails the upload now, not at the end
        try:
            self.sent.append(self.store.pool.submit(self._send, number, body))
        except BaseException:
            self.slots.release()
            raise

    def _send(self, number: int, body: bytes) -> dict[str, object]:
        try:
            answer = self.store.call(
                f"uploading part {number} of {self.key}",
                partial(
                    self.store.client.upload_part,
                    Bucket=self.store.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    PartNumber=number,
                    Body=body,
                ),
            )
            return {"PartNumber": number, "ETag": answer["ETag"]}
        finally:
            self.slots.release()

    def complete(self) -> None:
        parts = sorted((f.result() for f in self.sent), key=lambda p: int(str(p["PartNumber"])))
        self.store.call(
            f"completing the upload of {self.key}",
            partial(
                self.store.client.complete_multipart_upload,
                Bucket=self.store.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            ),
        )
        self.completed = True

    def abort(self) -> None:
        """Give the upload up (best effort: what remains is removed at the next start)."""
        for future in self.sent:
            future.cancel()
        wait(self.sent)
        with contextlib.suppress(WeightcastError):
            self.store.call(
                f"aborting the upload of {self.key}",
                partial(
                    self.store.client.abort_multipart_upload,
                    Bucket=self.store.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                ),
            )


class S3Version:
    """A version's objects; opening one asks its size and ETag (HEAD)."""

    def __init__(self, store: S3Store, parts: Sequence[str]) -> None:
        self.store = store
        self.parts = tuple(parts)
        self.label = f"s3://{store.bucket}/{store.key(*parts)}"

    def open(self, name: str, expected_bytes: int | None = None) -> S3Object:
        key = self.store.key(*self.parts, plain_name(name, "file"))
        label = f"s3://{self.store.bucket}/{key}"
        head = self.store.call(f"opening {name}", partial(self._head, key))
        size = head["ContentLength"]
        if expected_bytes is not None and size != expected_bytes:
            raise WeightsError(f"{label}: {size} bytes, the manifest says {expected_bytes}")
        identity = ("s3", str(head.get("ETag", "")), size, str(head.get("LastModified", "")))
        return S3Object(self.store, key, label, size, identity)

    def _head(self, key: str) -> dict[str, Any]:
        head: dict[str, Any] = self.store.client.head_object(Bucket=self.store.bucket, Key=key)
        if not isinstance(head.get("ContentLength"), int):  # the header's digits: BoundedSession
            raise UnusableReply("the answer gives no size (Content-Length)")
        return head

    def read_small(self, name: str, limit: int, expected_bytes: int | None = None) -> bytes:
        with self.open(name, expected_bytes) as f:
            if f.size > limit:
                raise WeightsError(
                    f"{f.label}: {f.size} bytes, more than the {limit} a {name} may have"
                )
            return f.read_at(0, f.size)

    def close(self) -> None:
        """Nothing is held open between requests."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3Object:
    """One object of a version, read by ranged GETs of the ETag it had when opened."""

    def __init__(self, store: S3Store, key: str, label: str, size: int, identity: Identity):
        self.store = store
        self.key = key
        self.label = label
        self.size = size
        self.identity = identity
        self.etag = str(identity[1])

    def read_at(self, offset: int, length: int) -> bytes:
        data = bytearray(length)
        self.read_into([memoryview(data)], offset)
        return bytes(data)

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        ranges = list(_ranges(buffers, offset))
        if len(ranges) == 1:
            self._get(*ranges[0])
            return
        gets = [self.store.pool.submit(self._get, *r) for r in ranges]
        wait(gets)  # none still writes into the caller's buffers once this returns or raises
        for get in gets:
            get.result()

    def _get(self, offset: int, views: list[memoryview]) -> None:
        """Bytes ``[offset, offset + total)`` into ``views``, retried whole on an outage."""
        total = sum(len(v) for v in views)
        if offset + total > self.size:
            raise WeightsError(f"{self.label}: ends at {self.size} bytes, before {offset + total}")

        def get() -> None:
            answer = self.store.client.get_object(
                Bucket=self.store.bucket,
                Key=self.key,
                Range=f"bytes={offset}-{offset + total - 1}",
                IfMatch=self.etag,
            )
            body = answer["Body"]
            raw = body._raw_stream  # urllib3's response: readinto without a copy
            try:
                length = answer.get("ContentLength")
                if length != total:
                    raise UnusableReply(f"asked for {total} bytes at {offset}, got {length}")
                if self.etag and answer.get("ETag", self.etag) != self.etag:
                    raise WeightsError(f"{self.label}: changed since it was opened (its ETag)")
                with cut_at_deadline(raw):
                    for view in views:
                        got = 0
                        while got < len(view):
                            n = raw.readinto(view[got : got + READ_PIECE_BYTES])
                            if not n:
                                raise UnusableReply("the answer ended early")
                            got += n
            finally:
                body.close()

        self.store.call(f"reading {self.label}", get)

    def close(self) -> None:
        """Nothing is held open between requests."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NO_DEADLINE = float("inf")


class _Deadline(threading.local):
    at = NO_DEADLINE


DEADLINE = _Deadline()
"""When the request this thread sends must have ended (:meth:`S3Store.call` sets it)."""


@contextlib.contextmanager
def cut_at_deadline(raw: BaseHTTPResponse) -> Iterator[None]:
    """Read ``raw``'s body within :data:`DEADLINE`: a read blocked then (a stalled or trickling
    endpoint) ends, as its connection is shut down, in an :class:`UnusableReply`."""
    try:
        fd: int | None = raw.fileno()
    except (OSError, ValueError):  # the answer holds no connection: no read can block
        fd = None
    with contextlib.ExitStack() as stack:
        if fd is not None and DEADLINE.at < NO_DEADLINE:
            # a socket object of its own on the connection: the answer may close its own first
            sock = stack.enter_context(socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM))
            timer = threading.Timer(max(0.0, DEADLINE.at - time.monotonic()), _shut, (sock,))
            timer.start()
            stack.callback(timer.cancel)
        try:
            yield
        except Exception:
            if time.monotonic() >= DEADLINE.at:
                raise UnusableReply("no complete answer within the request's deadline") from None
            raise


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class BoundedSession:
    """botocore's HTTP session, its answers checked before botocore reads them: a
    ``Content-Length`` must be digits; a body botocore would parse is read within the
    request's deadline, up to :data:`REPLY_BYTES` (:data:`ERROR_BYTES` for an error: a longer
    or too deeply nested one is dropped, its status says what it was); streamed object bodies
    are left to :meth:`S3Object.read_into`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def send(self, request: AWSPreparedRequest) -> AWSResponse:
        streamed = request.stream_output
        request.stream_output = True  # botocore would read the body whole, here
        response: AWSResponse = self.inner.send(request)
        raw: BaseHTTPResponse = response.raw
        length = response.headers.get("Content-Length")
        if length is not None and not (length.isascii() and length.isdigit()):
            _drop(raw)
            raise UnusableReply(f"Content-Length {length[:40]!r} is no size")
        if streamed and response.status_code < 300:
            return response
        if request.method == "HEAD":  # no body: its Content-Length is the object's size
            _drop(raw)
            return AWSResponse(response.url, response.status_code, response.headers, _Read(b""))
        error = response.status_code >= 300
        cap = ERROR_BYTES if error else REPLY_BYTES
        if length is not None and int(length) > cap:
            body = None
        else:
            with cut_at_deadline(raw):
                body = raw.read(cap + 1)
            body = body if len(body) <= cap and not _too_deep(body) else None
        if body is None:
            _drop(raw)
            if not error:
                raise UnusableReply(f"an answer of more than {cap} bytes, or nested too deep")
        return AWSResponse(response.url, response.status_code, response.headers, _Read(body))

    def close(self) -> None:
        self.inner.close()


class _Read:
    """A body read already, as botocore reads one (``stream()``)."""

    def __init__(self, body: bytes | None) -> None:
        self.body = body or b""

    def stream(self) -> Iterator[bytes]:
        yield self.body


def _drop(raw: BaseHTTPResponse) -> None:
    """Close an answer without reading the rest of it."""
    raw.close()
    raw.release_conn()


def _too_deep(body: bytes) -> bool:
    """Whether ``body`` is XML nested deeper than :data:`XML_DEPTH` (botocore's parser
    recurses); not XML at all is the parser's to say."""
    parser = XMLPullParser(("start", "end"))
    depth = 0
    try:
        parser.feed(body)
        for event, _ in parser.read_events():
            depth += 1 if event == "start" else -1
            if depth > XML_DEPTH:
                return True
    except ParseError:
        return False
    return False


def _ranges(buffers: Sequence[memoryview], offset: int) -> Iterator[tuple[int, list[memoryview]]]:
    """``buffers`` (consecutive from ``offset``) cut into GETs of at most PART_BYTES."""
    at, views, size = offset, [], 0
    for buffer in buffers:
        buffer = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        while len(buffer):
            take = min(len(buffer), PART_BYTES - size)
            views.append(buffer[:take])
            buffer, size = buffer[take:], size + take
            if size == PART_BYTES:
                yield at, views
                at, views, size = at + size, [], 0
    if size:
        yield at, views


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """``items`` in lists of ``size`` (the last may be shorter): Python 3.11 has no
    ``itertools.batched``."""
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _plain_parts(file: str) -> list[str]:
    """A version's file (``model.vllm-fused``, ``hf/config.json``) as plain names."""
    return [plain_name(part, "file") for part in file.split("/")]
