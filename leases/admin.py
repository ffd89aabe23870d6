"""The admin section "Leases and locks": who holds what, who waits, and taking a lock away.

Pages: leases of the database backend (a plain changelist, filters and search), leases on every
configured backend (through ``inspect_all``), Postgres advisory locks held or awaited (from
``pg_locks``), and the audit of forced releases. Nothing here edits or deletes a lease row: a
deleted row would restart the name's tokens and let a stale holder through every fence. Taking a
lease away is a force release (revokes the grant, advances the token) behind
``leases.force_release_lease`` and a confirmation page; it names the (name, token) the operator
saw, so a lease that changed hands meanwhile is left alone. Terminating a database session needs
``leases.terminate_lock_session`` and a confirmation page too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, TypeAlias

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, SuspiciousOperation
from django.db.models import QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.timesince import timesince

from . import conf, operations
from .backends import Capability, capabilities, get_backend
from .errors import LeaseError
from .models import AdvisoryLock, BackendLease, ForceRelease, Lease
from .paginator import EstimatedCountPaginator

VIEW_PERMISSION = "leases.view_lease"
#: Leases shown on the every-backend page, held first: stores keep a row per name ever used.
BACKEND_PAGE_LIMIT = 500
#: The most leases one force release takes (the action, a confirmed POST): each is an
#: ``inspect`` on the confirmation page, then a revocation, a release and an audit row, all in
#: one request. "Select all" over a table of every name ever used would run past any timeout
#: half-way; more than this, the operator filters the list first (by state, by name).
FORCE_RELEASE_LIMIT = BACKEND_PAGE_LIMIT


def aliases_with(capability: Capability) -> list[str]:
    """The configured aliases whose backend has ``capability`` with its options, asked of
    each backend's class (:func:`~leases.backends.capabilities`), not of its engine's name,
    so a backend added later, or one named differently, is found the same way."""
    found = []
    for alias in conf.get().backends:
        try:
            if capability in capabilities(alias):
                found.append(alias)
        except LeaseError:
            continue  # an engine that cannot be loaded is reported by manage.py check
    return found


def database_backend_alias() -> str:
    """The alias whose backend keeps its leases as the ``leases_lease`` rows shown here."""
    return next(iter(aliases_with(Capability.LEASE_ROWS)), "default")


def humanize_delta(delta: timedelta | None) -> str:
    """``12.5s``, ``expired 3.0s ago``, or a dash when unknown."""
    if delta is None:
        return "—"
    seconds = delta.total_seconds()
    return f"{seconds:.1f}s" if seconds > 0 else f"expired {-seconds:.1f}s ago"


def holder_cell(raw: str, meta: Mapping[str, Any] | None = None) -> str:
    """A holder identity as two short lines: ``host · pid`` over ``thread · label``; a group
    of readers as how many they are (``meta`` lists them), another holder as it is."""
    if not raw:
        return "—"
    parts = operations.parse_holder(raw)
    if parts.pid is None:
        return format_html("{}", operations.shown_holder(raw, meta))
    second = " · ".join(p for p in (f"thread {parts.thread}", parts.label) if p)
    return format_html("{} · pid {}<br><small>{}</small>", parts.host, parts.pid, second)


def see_also_links() -> list[tuple[str, str]]:
    """Links shown on every page of the section, including the idempotency keys' admin."""
    links = [
        ("Leases (database backend)", "admin:leases_lease_changelist"),
        ("Leases on every backend", "admin:leases_backendlease_changelist"),
        ("Advisory locks held or waiting", "admin:leases_advisorylock_changelist"),
        ("Force releases (audit)", "admin:leases_forcerelease_changelist"),
        ("Idempotency keys", "admin:idempotency_idempotencykey_changelist"),
    ]
    found = []
    for label, name in links:
        try:
            found.append((label, reverse(name)))
        except NoReverseMatch:
            continue
    return found


class LeaseStateFilter(admin.SimpleListFilter):
    """Held (a holder and time left), expired (a holder, no time left) or free (released)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(state, state) for state in operations.LEASE_STATES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        state = self.value()
        if state not in operations.LEASE_STATES:
            return queryset
        return operations.rows_in_state(queryset, str(state))


class _ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Operators look; the package alone writes lease state."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff) and request.user.has_perm(
            VIEW_PERMISSION
        )

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def section_context(self, request: HttpRequest, **extra: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "see_also": see_also_links(),
            "title": self.model._meta.verbose_name_plural.capitalize(),
            **extra,
        }


@admin.register(Lease)
class LeaseAdmin(_ReadOnlyAdmin):
    list_display = ["name", "state", "holder_parts", "token", "held_for", "expires_in", "backend"]
    list_filter = [LeaseStateFilter]
    search_fields = ["name"]
    actions = ["force_release"]
    change_list_template = "admin/leases/lease/change_list.html"
    #: Rows are never deleted, so the table grows with every name ever used: no page view
    #: may count it whole (the planner's estimate for large lists; see ``leases.paginator``).
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    #: The change page: every column but the secret's hash, and ``meta`` without the readers'.
    fields = ("name", "holder", "token", "acquired_at", "expires_at", "renewed_at", "meta_shown")
    readonly_fields = fields

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        return super().changelist_view(
            request, {**(extra_context or {}), "see_also": see_also_links()}
        )

    @admin.display(description="meta")
    def meta_shown(self, obj: Lease) -> str:
        return json.dumps(operations.shown_meta(obj), sort_keys=True, default=str)

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        """No filter on the secret's hash or on ``meta`` (the readers' hashes) from the URL:
        a filter answers yes or no about what the pages never show (and a hash given as text
        reached the database adapter: a 500). Refused, Django answers 400."""
        if lookup.split(LOOKUP_SEP, 1)[0] in ("secret_hash", "meta"):
            return False
        return bool(super().lookup_allowed(lookup, value, request))

    @admin.display(description="state")
    def state(self, obj: Lease) -> str:
        """The same three states as the filter, on the web server's clock (a hint)."""
        return operations.row_state(obj)

    @admin.display(description="holder", ordering="holder")
    def holder_parts(self, obj: Lease) -> str:
        """Host and pid on the first line, thread and label on a second (fits 1400 px)."""
        return holder_cell(obj.holder, obj.meta)

    @admin.display(description="held for", ordering="acquired_at")
    def held_for(self, obj: Lease) -> str:
        if operations.row_state(obj) != "held" or obj.acquired_at is None:
            return "—"
        return timesince(obj.acquired_at)

    @admin.display(description="expires in", ordering="expires_at")
    def expires_in(self, obj: Lease) -> str:
        if not obj.holder or obj.expires_at is None:
            return "—"
        return humanize_delta(obj.expires_at - timezone.now())

    @admin.display(description="backend")
    def backend(self, obj: Lease) -> str:
        return database_backend_alias()

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(operations.FORCE_RELEASE_PERMISSION))

    @admin.action(
        description="Force release (revoke: advance the fencing token)",
        permissions=["force_release"],
    )
    def force_release(self, request: HttpRequest, queryset: QuerySet[Lease]) -> HttpResponse | None:
        """Show the confirmation page for the selected rows, with the tokens shown now; none
        for more than :data:`FORCE_RELEASE_LIMIT` of them (only that many are read)."""
        alias = database_backend_alias()
        chosen = queryset.values_list("name", "token")[: FORCE_RELEASE_LIMIT + 1]
        targets: list[Target] = [(alias, name, token) for name, token in chosen]
        if too_many(self, request, targets):
            return None
        changelist = reverse("admin:leases_lease_changelist")
        return confirm_release(self, request, targets, changelist)


#: What the operator saw and confirms: (backend alias, name, token).
Target: TypeAlias = tuple[str, str, int]


def posted_targets(request: HttpRequest) -> list[Target]:
    """The targets a confirmation form posted: one ``targets`` field holding them all (one
    field per target, as the page had, made Django refuse a form of more than
    ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` of them), and any ``target`` fields (a page rendered
    before that change)."""
    targets = parse_targets(request.POST.getlist("target"))
    joined = request.POST.get("targets")
    if joined is not None:
        try:
            listed = json.loads(joined)
        except ValueError as exc:
            raise SuspiciousOperation("malformed force-release targets") from exc
        if not isinstance(listed, list):
            raise SuspiciousOperation("malformed force-release targets")
        targets += [_checked_target(item) for item in listed]
    return targets


def parse_targets(values: list[str]) -> list[Target]:
    """``["backend", "name", token]`` JSON triples from the confirmation form, checked."""
    targets = []
    for value in values:
        try:
            item = json.loads(value)
        except (TypeError, ValueError) as exc:
            raise SuspiciousOperation("malformed force-release target") from exc
        targets.append(_checked_target(item))
    return targets


def _checked_target(item: Any) -> Target:
    """One decoded ``[backend, name, token]``, checked."""
    alias: object
    name: object
    token: object
    try:
        alias, name, token = item
    except (TypeError, ValueError) as exc:
        raise SuspiciousOperation("malformed force-release target") from exc
    if not isinstance(alias, str):  # a list or dict would fail the lookup below (a 500)
        raise SuspiciousOperation("malformed force-release target")
    if alias not in conf.get().backends:
        raise PermissionDenied("unknown backend")
    if not isinstance(name, str) or isinstance(token, bool) or not isinstance(token, int):
        raise SuspiciousOperation("malformed force-release target")
    return (alias, name, token)


def too_many(
    model_admin: admin.ModelAdmin,  # type: ignore[type-arg]
    request: HttpRequest,
    targets: list[Target],
) -> bool:
    """More than :data:`FORCE_RELEASE_LIMIT` leases to release: refused whole, and said so
    (releasing the first ones only would leave the operator guessing which)."""
    if len(targets) <= FORCE_RELEASE_LIMIT:
        return False
    model_admin.message_user(
        request,
        f"Nothing was released: force-release at most {FORCE_RELEASE_LIMIT} leases at a time "
        "(each is several round trips, all in one request). Filter the list first, by state "
        "or by name, or use manage.py leases release for a script.",
        messages.ERROR,
    )
    return True


def confirm_release(
    model_admin: _ReadOnlyAdmin, request: HttpRequest, targets: list[Target], back: str
) -> HttpResponse:
    """The page that says what a force release will do to each lease, before it is done."""
    rows = []
    for alias, name, token in targets:
        try:
            now = get_backend(alias).inspect(name)
        except LeaseError as exc:
            now, error = None, str(exc)
        else:
            error = ""
        rows.append(
            {
                "alias": alias,
                "name": name,
                "token": token,
                "now": now,
                "changed": now is None or not now.held or now.token != token,
                "holder": operations.parse_holder(now.holder) if now else None,
                "shown": operations.shown_holder(now.holder, now.meta) if now else "",
                "error": error,
            }
        )
    count = len(rows)
    context = model_admin.section_context(
        request,
        rows=rows,
        targets=json.dumps([list(target) for target in targets]),
        back=back,
        title=f"Force-release {count} lease{'s' if count != 1 else ''}?",
    )
    return TemplateResponse(request, "admin/leases/confirm_release.html", context)


def release_and_report(
    model_admin: admin.ModelAdmin,  # type: ignore[type-arg]
    request: HttpRequest,
    targets: list[Target],
) -> None:
    """Force-release each confirmed target and tell the operator what happened to each."""
    for alias, name, token in targets:
        try:
            record = operations.force_release(
                name, backend=alias, token=token, user=request.user, via="admin"
            )
        except LeaseError as exc:
            model_admin.message_user(request, str(exc), messages.WARNING)
            continue
        model_admin.message_user(
            request,
            f"Released {name!r} on {alias!r}: token {record.token} revoked "
            f"(now {record.new_token}); holder {record.holder or '?'} was evicted.",
            messages.SUCCESS,
        )


class _PageAdmin(_ReadOnlyAdmin):
    """A page of its own (what a backend or ``pg_locks`` says now) on a proxy model: only its
    changelist is routed. Django's per-object views, reachable by URL with the same view
    permission, showed the proxied table's raw rows: a shared lease's ``meta`` with its
    readers' secret hashes, which every page of the package hides."""

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name=f"{self.opts.app_label}_{self.opts.model_name}_changelist")]


@admin.register(BackendLease)
class BackendLeaseAdmin(_PageAdmin):
    """Leases of every configured backend, read through the backend interface."""

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.release_view)
        return [path("release/", view, name="leases_backendlease_release"), *super().get_urls()]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        infos, errors, backend_waiters = operations.backend_overview(BACKEND_PAGE_LIMIT)
        now = timezone.now()
        # Offered only where the backend, as configured, can revoke: elsewhere it could only fail.
        revocable = set(aliases_with(Capability.FORCE_RELEASE))
        rows = []
        for info in infos:
            state = operations.lease_state(info)
            since = info.acquired_at if state == "held" else None
            held_for = timesince(since, now) if since is not None else "—"
            left = humanize_delta(operations.expires_in(info, now))
            releasable = info.held and info.backend in revocable
            holder = holder_cell(info.holder, info.meta)
            rows.append((info, state, holder, held_for, left, releasable))
        try:
            waiters = operations.lease_waiters()
        except PermissionDenied:  # no database has the leases tables: nobody waits in one
            waiters = []
        context = self.section_context(
            request,
            rows=rows,
            limit=BACKEND_PAGE_LIMIT if len(infos) >= BACKEND_PAGE_LIMIT else None,
            waiters=waiters,
            backend_waiters=backend_waiters,
            errors=errors,
            can_release=request.user.has_perm(operations.FORCE_RELEASE_PERMISSION),
        )
        return TemplateResponse(request, "admin/leases/backend_leases.html", context)

    def release_view(self, request: HttpRequest) -> HttpResponse:
        """A confirmation page on GET (``?backend=&name=&token=``); releases on a confirmed POST.

        Both the database changelist's action and this page's buttons end here, naming the
        token the operator saw, so the release is a compare-and-release on it.
        """
        if not self.has_view_permission(request):
            raise PermissionDenied
        if not request.user.has_perm(operations.FORCE_RELEASE_PERMISSION):
            raise PermissionDenied
        back = str(request.POST.get("next") or request.GET.get("next") or "")
        if not back or not url_has_allowed_host_and_scheme(back, allowed_hosts=None):
            back = reverse("admin:leases_backendlease_changelist")
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            targets = posted_targets(request)
            if not too_many(self, request, targets):
                release_and_report(self, request, targets)
            return HttpResponseRedirect(back)
        query = request.GET
        try:
            seen = [json.dumps([query["backend"], query["name"], int(query["token"])])]
        except (KeyError, ValueError) as exc:
            raise SuspiciousOperation("a force release names backend, name and token") from exc
        return confirm_release(self, request, parse_targets(seen), back)


@admin.register(AdvisoryLock)
class AdvisoryLockAdmin(_PageAdmin):
    """Postgres advisory locks held or awaited now, by name where the name was recorded."""

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.terminate_view)
        return [
            path("<int:pid>/terminate/", view, name="leases_advisorylock_terminate"),
            *super().get_urls(),
        ]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """One table per database where the ``leases`` app lives (usually just one)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        databases = operations.advisory_databases()
        context = self.section_context(
            request,
            databases=[(alias, operations.advisory_locks(alias)) for alias in databases],
            several=len(databases) > 1,
            can_terminate=request.user.has_perm(operations.TERMINATE_PERMISSION),
        )
        return TemplateResponse(request, "admin/leases/advisory_locks.html", context)

    def terminate_view(self, request: HttpRequest, pid: int) -> HttpResponse:
        """A confirmation page on GET; the termination itself only on a confirmed POST."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        if not request.user.has_perm(operations.TERMINATE_PERMISSION):
            raise PermissionDenied
        changelist = reverse("admin:leases_advisorylock_changelist")
        using = operations.advisory_database(
            str(request.POST.get("database") or request.GET.get("database") or "") or None
        )
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            started = _posted_start(request)
            try:
                operations.terminate_session(
                    pid, started=started, user=request.user, via="admin", using=using
                )
            except LeaseError as exc:
                self.message_user(request, str(exc), messages.WARNING)
            else:
                self.message_user(request, f"Session {pid} terminated.", messages.SUCCESS)
            return HttpResponseRedirect(changelist)
        rows = [row for row in operations.advisory_locks(using) if row.pid == pid]
        context = self.section_context(
            request,
            rows=rows,
            pid=pid,
            # The session this page shows: the confirmation terminates it, not a later one
            # the server gave the same pid.
            started=rows[0].started.isoformat() if rows and rows[0].started else "",
            database=using,
            title=f"Terminate database session {pid} on {using!r}?",
        )
        return TemplateResponse(request, "admin/leases/confirm_terminate.html", context)


def _posted_start(request: HttpRequest) -> datetime:
    """The start of the session the confirmation page showed (its ``started`` field)."""
    try:
        started = datetime.fromisoformat(str(request.POST["started"]))
    except (KeyError, ValueError) as exc:
        raise SuspiciousOperation("a terminate names the session's start, as shown") from exc
    if started.tzinfo is None:
        raise SuspiciousOperation("a terminate names the session's start, as shown")
    return started


@admin.register(ForceRelease)
class ForceReleaseAdmin(_ReadOnlyAdmin):
    list_display = ["at", "action", "name", "backend", "holder", "token", "new_token"]
    list_display += ["by_username", "via"]
    list_filter = ["action", "via", "backend"]
    search_fields = ["name", "holder", "by_username"]
    date_hierarchy = "at"
