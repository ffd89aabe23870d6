"""The ``Idempotency-Key`` header: an RFC 8941 sf-string item (parameters ignored) or bare key."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from idempotency import IdempotencyKeyInvalid, IdempotencyKeyMultiple
from idempotency.http import parse_key
from idempotency.models import IdempotencyKey

VALID = [
    ('"k-1"', "k-1"),
    ('"k-1";v=1', "k-1"),
    ('"k-1"; v=1', "k-1"),
    ('"k-1";v', "k-1"),
    ('"k-1";a;b=?0;c=?1', "k-1"),
    ('"k";a=-1.5;b=0.125;c=123456789012345', "k"),
    ('"k";a=tok;b=*t:o/k!;c=Tok', "k"),
    ('"k";a="x \\"y\\" \\\\";b=""', "k"),
    ('"k";a=:aGVsbG8=:;b=::', "k"),
    ('"k";*a=1;a-b_c.d*=2;a=3', "k"),
    ('  "k";v=1  ', "k"),
    ('"a;b=c"', "a;b=c"),
    ("bare-stripe-key", "bare-stripe-key"),
    ("7f9c2a1e-3b4d-4c5e-8f60-123456789abc", "7f9c2a1e-3b4d-4c5e-8f60-123456789abc"),
    ("with space", "with space"),
    ('"' + "k" * 255 + '";v=1', "k" * 255),
]

MALFORMED = [
    '""',
    '"";v=1',
    '"k";',
    '"k"; ',
    '"k";;v=1',
    '"k";V=1',
    '"k";1a=2',
    '"k";-a=2',
    '"k";a=',
    '"k";a= 1',
    '"k";a="open',
    '"k";a="bad\\escape"',
    '"k";a=1.2345',
    '"k";a=1.',
    '"k";a=1234567890123456',
    '"k";a=-',
    '"k";a=?2',
    '"k";a=?',
    '"k";a=:not base64!:',
    '"k";a=:open',
    '"k";a=@',
    '"k";a=1x',
    '"k" ;v=1',
    '"k";v=1 x',
    '"k" trailing',
    '"k"tail',
    '"' + "k" * 256 + '";v=1',
    "k" * 256,
    'bare"quote',
    "tab\there",
]

MULTIPLE = ['"a", "b"', '"a";v=1, "b"', '"a";v=1,"b";v=2', "a,b"]


@pytest.mark.parametrize(("header", "key"), VALID)
def test_valid_headers_name_their_key(header: str, key: str) -> None:
    assert parse_key(header) == key


@pytest.mark.parametrize("header", MALFORMED)
def test_malformed_headers_are_refused(header: str) -> None:
    with pytest.raises(IdempotencyKeyInvalid) as caught:
        parse_key(header)
    assert caught.value.value == header and caught.value.reason


@pytest.mark.parametrize("header", MULTIPLE)
def test_several_keys_are_refused(header: str) -> None:
    with pytest.raises(IdempotencyKeyMultiple):
        parse_key(header)


@pytest.mark.django_db
def test_a_key_with_parameters_replays_the_same_key_without_them(client: Client) -> None:
    client.session  # an identity to scope the key
    body, kind = json.dumps({"amount": 1}), "application/json"
    first = client.post("/idem/charge/", body, kind, HTTP_IDEMPOTENCY_KEY='"k-1";v=1')
    again = client.post("/idem/charge/", body, kind, HTTP_IDEMPOTENCY_KEY='"k-1"')
    assert first.status_code == 201 and "Idempotent-Replayed" not in first
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert IdempotencyKey.objects.get().key == "k-1"
