"""Read-only admin for idempotency keys: for looking up what a client's key did, not changing it.

Nothing can be added, edited or deleted here. Editing a key would change what a retry replays;
deleting one would make the key usable again, so the client's next retry would run the effect a
second time. Keys go when they expire (``purge_idempotency_keys``).

A stored response is what one client was told, so its headers and body are shown only to users
with the ``idempotency.view_response_body`` permission (superusers have every permission); the
view permission alone shows the key, its state and status.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest

from leases.paginator import EstimatedCountPaginator

from .models import IdempotencyKey

RESPONSE_PERMISSION = "idempotency.view_response_body"
RESPONSE_FIELDS = ("response_headers", "response_preview")
#: Fields no changelist filter may name (see :meth:`IdempotencyKeyAdmin.lookup_allowed`).
UNFILTERED_FIELDS = frozenset({"response_headers", "response_body", "steps"})
FIELDS: tuple[str, ...] = (
    "scope",
    "key",
    "fingerprint",
    "state",
    "owner",
    "locked_until",
    "response_status",
    *RESPONSE_FIELDS,
    "created_at",
    "expires_at",
)


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("key", "scope", "state", "response_status", "created_at", "expires_at")
    #: ``created_at`` as a filter (fixed choices: today, past 7 days...), not a
    #: ``date_hierarchy``, which lists the distinct years of the whole table on every view.
    list_filter = ("state", "created_at")
    search_fields = ("key", "scope")
    ordering = ("-created_at",)
    #: Keys pile up for a day or more (millions): no page view counts the table whole.
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    fields = FIELDS
    readonly_fields = FIELDS

    @admin.display(description="response body")
    def response_preview(self, obj: IdempotencyKey) -> str:
        body = bytes(obj.response_body or b"")
        text = body[:2000].decode("utf-8", errors="replace")
        return text + (" ..." if len(body) > 2000 else "")

    def get_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        """The stored response only for users allowed to read it."""
        if request.user.has_perm(RESPONSE_PERMISSION):
            return FIELDS
        return tuple(name for name in FIELDS if name not in RESPONSE_FIELDS)

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        """No filter on the stored response or the steps, from the URL, for anyone.

        Django's changelist accepts a filter on any field of the model: whether a key is
        listed for ``response_headers__icontains=...`` answers yes or no, so a user without
        the permission to read responses read them back a character at a time. The admin's
        own filters never use these fields (refused, Django answers 400)."""
        if lookup.split(LOOKUP_SEP, 1)[0] in UNFILTERED_FIELDS:
            return False
        return bool(super().lookup_allowed(lookup, value, request))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
