"""Request fingerprints: what makes two requests under one key "the same request".

A fingerprint is the method, the path with its query string, the media type (``Content-Type``)
and the body. The media type says what the bytes mean (``{"amount": 42}`` is a charge as JSON,
a form field with no value as ``application/x-www-form-urlencoded``), so it counts, by its
meaning rather than its spelling (:func:`_media_type_parts`). The body is hashed as
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

Versions up to 0.1.0 fingerprinted the method, the path and the body alone: the **legacy**
fingerprint. It is the first part of today's (one body pass gives both), and the key store
matches a request's legacy fingerprint too (:func:`idempotency.store.begin`), so a key stored
before the upgrade still replays to its retry, and a crashed attempt's steps resume with the
derived keys they were given. Today's fingerprints never equal a legacy one (another number of
parts, under SHA-256), so a key stored since is bound to its media type.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
from collections.abc import Iterable
from tempfile import SpooledTemporaryFile
from typing import IO, Any, BinaryIO, NamedTuple, cast

from django.conf import settings
from django.http import HttpRequest
from django.utils.http import parse_header_parameters

from . import drf

__all__ = ["Fingerprints", "default_fingerprint", "digest", "fingerprints"]

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


#: Media type parameters that frame the body rather than say what it means: a multipart
#: boundary is picked anew for each attempt (and is in the body's bytes where they count).
_FRAMING_PARAMETERS = frozenset({"boundary"})
#: Parameters whose values are case-insensitive (RFC 9110 section 8.3.2); others are kept as sent.
_CASELESS_PARAMETERS = frozenset({"charset"})


def _media_type_parts(request: HttpRequest) -> list[bytes]:
    """The media type as it counts: type and subtype lowercased, then each parameter's name
    and value, by name (names lowercased, quoted values unquoted, whitespace dropped: Django's
    parse of the header, made with the request), the charset's value lowercased and the
    multipart boundary left out. ``application/json;charset="UTF-8"`` is
    ``application/json; charset=utf-8``."""
    media_type, params = request.content_type, request.content_params
    if media_type is None or params is None:  # a bare HttpRequest, not made from a WSGI/ASGI one
        media_type, params = parse_header_parameters(request.META.get("CONTENT_TYPE", ""))
    parts = [media_type.encode()]
    for name, value in sorted(params.items()):
        if name not in _FRAMING_PARAMETERS:
            parts += (
                name.encode(),
                (value.lower() if name in _CASELESS_PARAMETERS else value).encode(),
            )
    return parts


class Fingerprints(NamedTuple):
    """A request's fingerprint, and the one versions up to 0.1.0 gave it (see the module)."""

    current: str
    legacy: str


def fingerprints(request: Any) -> Fingerprints:
    """The request's fingerprint and its legacy one, from one pass over the body.

    Takes Django's request or DRF's (whose underlying request is hashed, so both decorator
    positions agree). The legacy one is ``digest([method, path, body])`` for a plain body;
    the fingerprint is ``digest([legacy, media type, parameter name, value, ...])``.
    """
    request = drf.http_request(request)
    hasher = _Digest()
    hasher.part((request.method or "").encode())
    hasher.part(request.get_full_path().encode())
    _add_body(hasher, request)
    legacy = hasher.hexdigest()
    return Fingerprints(digest([legacy.encode(), *_media_type_parts(request)]), legacy)


def default_fingerprint(request: Any) -> str:
    """Method, path with query string, media type and body: what makes two requests "the
    same" (:func:`fingerprints`)."""
    return fingerprints(request).current
