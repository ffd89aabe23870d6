"""Read-only admin for idempotency keys: for looking up what a client's key did, not editing it.

Editing a key would change what a retry replays, so every field is read-only and keys can only be
removed (which makes the key usable again, as after expiry).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import IdempotencyKey


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("key", "scope", "state", "response_status", "created_at", "expires_at")
    list_filter = ("state",)
    search_fields = ("key", "scope")
    ordering = ("-created_at",)
    date_hierarchy = "created_at"
    exclude = ("response_body",)
    readonly_fields = (
        "scope",
        "key",
        "fingerprint",
        "state",
        "owner",
        "locked_until",
        "response_status",
        "response_headers",
        "response_preview",
        "created_at",
        "expires_at",
    )

    @admin.display(description="response body")
    def response_preview(self, obj: IdempotencyKey) -> str:
        body = bytes(obj.response_body or b"")
        text = body[:2000].decode("utf-8", errors="replace")
        return text + (" ..." if len(body) > 2000 else "")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
