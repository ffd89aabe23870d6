"""Request bodies in the fingerprint: file contents count, the multipart boundary does not, and a
keyed request meets the same size limits as an unkeyed one, without being buffered whole."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import AsyncClient, Client, override_settings
from django.test.client import encode_multipart

from tests.test_idempotency import identified, problem_type
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.django_db

CSRF_SECRET = "a" * 32
BIG = 5000


def csrf_client() -> Client:
    """A client whose POSTs pass real CSRF checks: the middleware reads ``request.POST`` (and so
    parses a multipart body) before the view and its guard run."""
    client = identified(Client(enforce_csrf_checks=True))
    client.cookies["csrftoken"] = CSRF_SECRET
    return client


def upload(client: Client, url: str, key: str | None, content: bytes, **extra: Any) -> Any:
    data = {"csrfmiddlewaretoken": CSRF_SECRET, "doc": SimpleUploadedFile("a.txt", content)}
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    return client.post(url, data, **extra)


@pytest.mark.parametrize("url", ["/idem/upload/", "/idem/upload-exempt/"])
def test_file_contents_are_part_of_the_fingerprint(url: str) -> None:
    """Same key, field, file name and size, other contents: another request, so 422."""
    client = csrf_client()
    first = upload(client, url, "k-up", b"aaaa")
    assert first.status_code == 201
    assert json.loads(first.content)["files"]["doc"] == hashlib.sha256(b"aaaa").hexdigest()
    other = upload(client, url, "k-up", b"bbbb")
    assert other.status_code == 422 and problem_type(other) == "idempotency-key-mismatch"
    again = upload(client, url, "k-up", b"aaaa")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert Charge.objects.count() == 1


def test_a_retry_encoded_with_another_boundary_is_the_same_request() -> None:
    """Clients pick a new multipart boundary per attempt; the retry must still replay."""
    client = identified(Client())
    fields: dict[str, Any] = {"amount": "5", "doc": SimpleUploadedFile("a.txt", b"same")}
    replies = []
    for boundary in ("first-boundary", "second-boundary"):
        fields["doc"].seek(0)
        replies.append(
            client.post(
                "/idem/upload-exempt/",
                encode_multipart(boundary, fields),
                content_type=f"multipart/form-data; boundary={boundary}",
                HTTP_IDEMPOTENCY_KEY="k-boundary",
            )
        )
    first, retry = replies
    assert first.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_repeated_fields_values_in_another_order_are_another_request() -> None:
    """``pick=gold, pick=silver`` is not ``pick=silver, pick=gold`` (a ranking, an ordered
    list: ``getlist`` keeps the order), as in a urlencoded body: 422. The fields' own order
    still does not count (a form is read by name). The values used to be sorted, so the
    reordered list replayed the first answer."""
    client = identified(Client())

    def send(fields: dict[str, Any]) -> Any:
        return client.post("/idem/upload-exempt/", fields, HTTP_IDEMPOTENCY_KEY="k-ranking")

    first = send({"pick": ["gold", "silver"], "amount": "5"})
    assert first.status_code == 201
    reordered = send({"pick": ["silver", "gold"], "amount": "5"})
    assert reordered.status_code == 422 and problem_type(reordered) == "idempotency-key-mismatch"
    fields_swapped = send({"amount": "5", "pick": ["gold", "silver"]})
    assert fields_swapped["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_form_without_reordered_values_keeps_the_fingerprint_it_had(rf: Any) -> None:
    """Keys stored before the fix above must still match their retries: a form whose repeated
    values come sorted (and any form without repeated fields) is fingerprinted as before."""
    from idempotency.fingerprint import _form_part

    request = rf.post("/", {"b": ["1", "2"], "a": "x"})
    assert _form_part(request) == json.dumps([[["a", "x"], ["b", "1"], ["b", "2"]], []]).encode()


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
@pytest.mark.parametrize("key", [None, "k-big"])
def test_large_uploads_meet_the_same_limits_with_or_without_a_key(key: str | None) -> None:
    """Files do not count against DATA_UPLOAD_MAX_MEMORY_SIZE in Django, nor do streamed raw
    bodies; a body the view reads whole does, keyed or not."""
    client = identified(Client())
    content = b"x" * BIG
    assert upload(client, "/idem/upload-exempt/", key, content).status_code == 201
    extra: dict[str, Any] = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key + "-raw"}
    streamed = client.post("/idem/upload-stream/", content, "application/octet-stream", **extra)
    assert streamed.status_code == 201
    assert json.loads(streamed.content)["sha256"] == hashlib.sha256(content).hexdigest()
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key + "-json"
    body = json.dumps({"amount": 1, "pad": "x" * BIG})
    whole = client.post("/idem/charge/", body, "application/json", **extra)
    assert whole.status_code == 400


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=None)
@pytest.mark.parametrize("url", ["/idem/upload-exempt/", "/idem/upload-stream/"])
def test_hashing_a_body_streams_it_without_reading_it_whole(url: str) -> None:
    client = identified(Client())
    content = b"y" * BIG
    if url.endswith("upload-exempt/"):
        reply = upload(client, url, "k-stream", content)
    else:
        reply = client.post(url, content, "application/octet-stream", HTTP_IDEMPOTENCY_KEY="k-s")
    assert reply.status_code == 201 and json.loads(reply.content)["buffered"] is False


@pytest.mark.django_db(transaction=True)
def test_an_asgi_body_is_hashed_where_it_is_spooled() -> None:
    """ASGI spools the body to a seekable file already; it is hashed there and rewound."""
    client = identified(AsyncClient())
    content = b"z" * BIG

    def send(body: bytes) -> Any:
        return async_to_sync(client.post)(
            "/idem/upload-stream/",
            body,
            "application/octet-stream",
            headers={"Idempotency-Key": "k-a"},
        )

    first = send(content)
    assert first.status_code == 201
    assert json.loads(first.content)["sha256"] == hashlib.sha256(content).hexdigest()
    assert send(content)["Idempotent-Replayed"] == "true"
    assert send(content[:-1] + b"!").status_code == 422


@pytest.mark.parametrize("spill_first", [True, False])
def test_a_streamed_body_hashes_alike_in_memory_and_spooled(spill_first: bool) -> None:
    """A raw body within FILE_UPLOAD_MAX_MEMORY_SIZE is copied in memory, a larger one into a
    spooled file; the view reads every byte either way, and the two copies fingerprint alike,
    so a retry sent while the limit differs (another worker's settings) still replays."""
    client = identified(Client())
    content = bytes(range(256)) * 20

    def send(body: bytes, limit: int) -> Any:
        with override_settings(FILE_UPLOAD_MAX_MEMORY_SIZE=limit):
            return client.post(
                "/idem/upload-stream/", body, "application/octet-stream", HTTP_IDEMPOTENCY_KEY="k-m"
            )

    spilled, in_memory = len(content) // 3, len(content) * 2
    first = send(content, spilled if spill_first else in_memory)
    assert first.status_code == 201
    assert json.loads(first.content)["sha256"] == hashlib.sha256(content).hexdigest()
    retry = send(content, in_memory if spill_first else spilled)
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert send(content[:-1] + b"!", spilled).status_code == 422
    assert send(content[:-1] + b"!", in_memory).status_code == 422
