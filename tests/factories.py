"""factory-boy factories for the models tests use."""

from __future__ import annotations

import factory
from django.contrib.auth import get_user_model


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")
    password = factory.django.Password("password")


class StaffUserFactory(UserFactory):
    is_staff = True


class AdvisoryCounterFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = "testapp.AdvisoryCounter"

    name = factory.Sequence(lambda n: f"counter{n}")
    value = 0
