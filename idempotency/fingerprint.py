"""Request fingerprints: what makes two requests under one key "the same request".

A fingerprint is the method, the path with its query string, and the body. The body is hashed as
it streams, never held whole in memory past ``FILE_UPLOAD_MAX_MEMORY_SIZE``, and read the way
Django itself reads it, so a keyed request meets exactly the limits an unkeyed one does
(``DATA_UPLOAD_MAX_MEMORY_SIZE`` and its siblings apply where Django applies them, and nowhere
else):

- a multipart form (POST) is parsed by Django, files streaming through the upload handlers (to
  disk past ``FILE_UPLOAD_MAX_MEMORY_SIZE``); its fields, file names and file *contents* are
  hashed. The boundary, which a client picks anew for each attempt, is not part of it, so a retry
  encoded with another boundary is still the same request;
- a body already read into memory (``request.body``) is hashed as it is;
- any other body is copied chunk by chunk while it is hashed (in memory up to
  ``FILE_UPLOAD_MAX_MEMORY_SIZE``, past that into a spooled temporary file), and the view reads
  that copy in place of the original stream (``request.read()``, ``request.body``,
  ``request.POST`` and DRF's parsers all see the same bytes).

Django keeps a request's stream in private attributes (``_stream``, ``_read_started``,
``_body``); this module is the one place that touches them.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
from collections.abc import Iterable
from tempfile import SpooledTemporaryFile
from typing import IO, Any, BinaryIO, cast

from django.conf import settings
from django.http import HttpRequest

from . import drf

__all__ = ["default_fingerprint", "digest"]

CHUNK_SIZE = 64 * 1024


class _Digest:
    """SHA-256 over length-prefixed parts, so no two sequences of parts hash alike."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def part(self, data: bytes) -> None:
        self.sized_part(len(data), [data])

    def sized_part(self, size: int, chunks: Iterable[bytes]) -> None:
        self._hash.update(size.to_bytes(8, "big"))
        for chunk in chunks:
            self._hash.update(chunk)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def digest(parts: Iterable[bytes]) -> str:
    """A 64-character hex digest, the form every fingerprint is stored in."""
    hasher = _Digest()
    for part in parts:
        hasher.part(part)
    return hasher.hexdigest()


def _chunks(stream: IO[bytes]) -> Iterable[bytes]:
    return iter(lambda: stream.read(CHUNK_SIZE), b"")


def _is_parsed_form(request: HttpRequest) -> bool:
    """A multipart POST, which Django parses (and streams files of) on ``request.POST``; other
    methods' multipart bodies are never parsed by Django, so they are hashed as bytes."""
    return request.method == "POST" and request.content_type == "multipart/form-data"


def _name(field: tuple[str, list[Any]]) -> str:
    return field[0]


def _form_part(request: HttpRequest) -> bytes:
    """Fields, and each file's field, name, size and content hash; files are rewound after.

    Fields by name (a form is read by name, so their order does not count), each one's values
    in the order sent (``getlist`` keeps it: a ranking, an ordered list). Values in ascending
    order list as the earlier fingerprint's pairs sorted whole did, so keys stored before it
    still match."""
    fields = [(k, v) for k, values in sorted(request.POST.lists(), key=_name) for v in values]
    files = []
    for field, uploads in sorted(request.FILES.lists()):
        for upload in uploads:
            content = hashlib.sha256()
            for chunk in upload.chunks(CHUNK_SIZE):
                content.update(chunk)
            upload.seek(0)
            files.append((field, upload.name or "", upload.size or 0, content.hexdigest()))
    return json.dumps([fields, files]).encode()


def _seekable_body(request: HttpRequest) -> BinaryIO | bytes:
    """The unread body as a seekable stream at its start (ASGI's own spooled file), or a copy
    of WSGI's socket stream put in its place, so the view still reads every byte: the bytes
    themselves (an in-memory stream for the view) while they fit in
    ``FILE_UPLOAD_MAX_MEMORY_SIZE``, where a spooled file would have kept them in memory too,
    and past that a spooled file."""
    stream = request._stream
    if stream.seekable():
        return stream
    limit = settings.FILE_UPLOAD_MAX_MEMORY_SIZE
    chunks: list[bytes] = []
    size = 0
    for chunk in _chunks(stream):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    else:
        body = b"".join(chunks)
        request._stream = io.BytesIO(body)
        return body
    spool = SpooledTemporaryFile(  # noqa: SIM115 (the request owns it from here)
        max_size=limit, dir=settings.FILE_UPLOAD_TEMP_DIR
    )
    for chunk in itertools.chain(chunks, _chunks(stream)):  # what was read, then the rest
        spool.write(chunk)
    spool.seek(0)
    request._stream = cast(BinaryIO, spool)
    return request._stream


def _add_body(hasher: _Digest, request: HttpRequest) -> None:
    if _is_parsed_form(request):
        hasher.part(_form_part(request))
        return
    read = getattr(request, "_read_started", False)
    if hasattr(request, "_body") or read or not hasattr(request, "_stream"):
        hasher.part(request.body)  # cached, or RawPostDataException: the stream is gone
        return
    body = _seekable_body(request)
    if isinstance(body, bytes):
        hasher.part(body)
        return
    start = body.tell()
    size = body.seek(0, 2) - start
    body.seek(start)
    hasher.sized_part(size, _chunks(body))
    body.seek(start)


def default_fingerprint(request: Any) -> str:
    """Method, path with query string and body: what makes two requests "the same".

    Takes Django's request or DRF's (whose underlying request is hashed, so both decorator
    positions agree). Equal to ``digest([method, path, body])`` for a plain body.
    """
    request = drf.http_request(request)
    hasher = _Digest()
    hasher.part((request.method or "").encode())
    hasher.part(request.get_full_path().encode())
    _add_body(hasher, request)
    return hasher.hexdigest()
