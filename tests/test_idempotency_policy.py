"""Which answers a key keeps: refusals of requests that never ran are not stored."""

from __future__ import annotations

import pytest
from django.test import Client, override_settings

from idempotency.checks import check_settings
from idempotency.models import IdempotencyKey
from tests.factories import UserFactory
from tests.test_idempotency import _basic, _no_failures, client, post
from tests.testapp import views_idempotency
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.django_db

__all__ = ["_no_failures", "client"]

FAILURES = views_idempotency.FAILURES
GUARDED = "/idem/drf-guarded/"


@pytest.mark.parametrize(("kind", "status"), [("throttle", 429), ("forbid", 403)])
def test_a_drf_refusal_is_not_stored_and_the_retry_runs(
    client: Client, kind: str, status: int
) -> None:
    """A throttle's 429 (with its Retry-After) or a permission's 403 answered a request that
    never ran: storing it would refuse the client for the key's whole lifetime."""
    UserFactory(username="carol")
    FAILURES[kind] = 1
    refused = post(client, GUARDED, "k-refused", HTTP_AUTHORIZATION=_basic("carol"))
    assert refused.status_code == status
    if status == 429:
        assert refused["Retry-After"] == "30"
    assert IdempotencyKey.objects.count() == 0 and Charge.objects.count() == 0
    retry = post(client, GUARDED, "k-refused", HTTP_AUTHORIZATION=_basic("carol"))
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert (
        post(client, GUARDED, "k-refused", HTTP_AUTHORIZATION=_basic("carol"))[
            "Idempotent-Replayed"
        ]
        == "true"
    )
    assert Charge.objects.count() == 1


def test_a_429_from_the_view_rolls_its_effects_back(client: Client) -> None:
    FAILURES["refuse"] = 1
    assert post(client, "/idem/flaky/", "k-429").status_code == 429
    assert IdempotencyKey.objects.count() == 0 and Charge.objects.count() == 0
    assert post(client, "/idem/flaky/", "k-429").status_code == 201
    assert Charge.objects.count() == 1


@override_settings(IDEMPOTENCY={"NOT_STORED_STATUSES": [404]})
def test_the_statuses_not_stored_are_a_setting(client: Client) -> None:
    FAILURES["refuse"] = 1
    first = post(client, "/idem/flaky/", "k-keep-429")
    again = post(client, "/idem/flaky/", "k-keep-429")
    assert first.status_code == again.status_code == 429
    assert again["Idempotent-Replayed"] == "true" and Charge.objects.count() == 1


@pytest.mark.parametrize("bad", ["429", [429, "403"], [99], [600], [True], None])
def test_a_bad_not_stored_statuses_setting_is_reported(bad: object) -> None:
    with override_settings(IDEMPOTENCY={"NOT_STORED_STATUSES": bad}):
        messages = [message.msg for message in check_settings()]
    assert len(messages) == 1 and "NOT_STORED_STATUSES" in messages[0]
