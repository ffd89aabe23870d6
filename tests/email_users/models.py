from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser, BaseUserManager, PermissionsMixin
from django.db import models


class EmailUserManager(BaseUserManager["EmailUser"]):
    def create_user(self, email: str, password: str | None = None, **extra: Any) -> EmailUser:
        user = self.model(email=email, **extra)
        user.set_password(password)
        user.save(using=self._db)
        return user


class EmailUser(AbstractBaseUser, PermissionsMixin):
    """No ``username``: ``USERNAME_FIELD`` is the e-mail address (up to 254 characters)."""

    email = models.EmailField(unique=True)
    is_staff = models.BooleanField(default=False)
    is_active = models.BooleanField(default=True)

    USERNAME_FIELD = "email"
    objects = EmailUserManager()
