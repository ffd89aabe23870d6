"""Fencing: the protected resource refuses writes that carry a stale token.

A lease can be lost while its holder is paused, so the holder's belief that it holds the lease
proves nothing when its write arrives. Safety lives here instead: every write carries the lease's
token, and the resource accepts it only if no greater token has been accepted before, in the
same statement that makes the change (a separate check would be a race of its own).

- :class:`FencedModel` rows remember the highest token in ``fencing_token``;
  ``obj.save(fence=lease)`` is one conditional ``UPDATE`` (``... AND fencing_token <= token``).
- ``Model.objects.fenced(lease)`` gives querysets whose ``update()``/``bulk_update()`` are
  fenced the same way, all or nothing.
- :func:`check_fence` guards resources that are not rows (files, external APIs) through the
  ``leases_fence`` table.

Equal tokens are accepted (one holder writes many times), lower ones never. A rejection raises
:class:`~leases.errors.StaleFencingToken`, sends ``fence_rejected`` (``sender`` is the model
class, :class:`~leases.models.Fence` for ``check_fence``) and logs a warning.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeAlias, TypeVar, runtime_checkable

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, models, router, transaction
from django.db.models.constants import OnConflict
from django.db.models.expressions import Value
from django.db.models.functions import Greatest

from . import revocation, signals
from .errors import FenceRequired, FencingTokenRevoked, InvalidFencingToken, StaleFencingToken
from .keys import validate_name
from .revocation import NOT_REVOKED_SQL, Offer

if TYPE_CHECKING:
    from django.db.models.sql.subqueries import InsertQuery

__all__ = [
    "FENCE_SQL",
    "FENCE_TOKEN_FIELD",
    "FenceHolder",
    "FenceLike",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "check_fence",
    "fence_offer",
    "fence_token",
]

logger = logging.getLogger(__name__)
_M = TypeVar("_M", bound=models.Model)
#: A query parameter in Django's SQL (``%%`` is an escaped percent sign, not a parameter).
_PLACEHOLDER = re.compile(r"%%|%s")

FENCE_TOKEN_FIELD = "fencing_token"  # noqa: S105 (a column name, not a secret)
_INT64_MAX = 2**63 - 1
#: A fenced UPDATE can miss a row another transaction committed while it ran (READ COMMITTED
#: snapshot); the retry sees it. Two tries always decide; the third is slack.
_UPDATE_ATTEMPTS = 3

#: check_fence's one statement: insert the first token or advance to a token not lower than the
#: stored one; no row comes back when the stored token is greater (the write is stale) or the
#: lease behind it was revoked (parameters: resource, token, then backend, name, token of the
#: revocation check; a bare-int fence passes NULLs, which match no revocation).
FENCE_SQL = (
    "INSERT INTO leases_fence (resource, token) SELECT %s::varchar, %s::bigint "
    f"WHERE {NOT_REVOKED_SQL} "
    "ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token "
    "WHERE leases_fence.token <= EXCLUDED.token "
    "RETURNING token"
)
#: Read only after a rejection, to tell the caller which token beat it.
FENCE_STORED_SQL = "SELECT token FROM leases_fence WHERE resource = %s"
#: Appended to Django's ``INSERT ... ON CONFLICT (pk) DO UPDATE SET ...`` for a fenced insert.
UPSERT_FENCE_SQL = " WHERE {table}.{column} <= EXCLUDED.{column} RETURNING {returning}"


@runtime_checkable
class FenceHolder(Protocol):
    """Anything that carries a fencing token and knows whether it still holds it (a Lease)."""

    @property
    def token(self) -> int: ...

    def ensure_held(self) -> None: ...


#: What ``fence=`` accepts: a token, or a lease whose token is used after ``ensure_held()``.
FenceLike: TypeAlias = int | FenceHolder


def _valid_token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidFencingToken(token, f"must be an int, not {type(token).__name__}")
    if not 1 <= token <= _INT64_MAX:
        raise InvalidFencingToken(token, "must be between 1 and 2**63 - 1")
    return token


def _valid_fence(fence: object) -> None:
    """Refuse what can never fence (``None``, a string, a float) when it is given, not later."""
    if isinstance(fence, int):
        _valid_token(fence)
    elif not isinstance(fence, FenceHolder):
        raise InvalidFencingToken(
            fence, f"must be an int or a lease (token + ensure_held), not {type(fence).__name__}"
        )


def fence_offer(fence: FenceLike) -> Offer:
    """The token to write with, and the grant it came from, failing fast on a lost lease.

    A holder whose keepalive saw the loss (or whose validity ran out) raises ``LeaseLost`` here
    even when nobody newer has written yet: the database fence alone could not tell
    (DESIGN invariant 5). A lease also names its grant (backend alias and name), which lets the
    fenced statement refuse a grant an operator revoked; a bare int cannot.
    """
    if isinstance(fence, Offer):
        return fence
    _valid_fence(fence)
    if isinstance(fence, int):
        return Offer(fence)
    fence.ensure_held()
    token = _valid_token(fence.token)
    backend, name = getattr(fence, "backend", None), getattr(fence, "name", None)
    if isinstance(backend, str) and isinstance(name, str):
        return Offer(token, backend, name)
    return Offer(token)


def fence_token(fence: FenceLike) -> int:
    """The token to write with (see :func:`fence_offer`)."""
    return fence_offer(fence).token


def _revoked(sender: Any, resource: str, offer: Offer, through: int) -> FencingTokenRevoked:
    lease = f"{offer.name!r} on {offer.backend!r}"
    logger.warning(
        "fenced write to %s rejected: token %s of lease %s was revoked",
        resource,
        offer.token,
        lease,
    )
    signals.fence_rejected.send_robust(
        sender=sender, resource=resource, offered=offer.token, stored=None
    )
    return FencingTokenRevoked(resource, offer.token, lease, through)


def _reject(sender: Any, resource: str, offered: int, stored: int | None) -> StaleFencingToken:
    logger.warning(
        "fenced write to %s rejected: offered token %s, stored %s", resource, offered, stored
    )
    signals.fence_rejected.send_robust(
        sender=sender, resource=resource, offered=offered, stored=stored
    )
    return StaleFencingToken(resource, offered, stored)


def _has_fence_column(model: type[models.Model]) -> bool:
    """Whether ``model``'s own table holds the fence (not a multi-table parent's)."""
    return any(f.attname == FENCE_TOKEN_FIELD for f in model._meta.local_concrete_fields)


def check_fence(resource: str, fence: FenceLike, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """Advance ``resource``'s fence to the token, or raise ``StaleFencingToken``; one statement.

    Runs on the caller's connection and inside the caller's transaction, on purpose: when the
    guarded effect is in the same database, wrap both in ``transaction.atomic()`` and the fence
    advances if and only if the effect commits, while the fence row stays locked so a
    concurrent stale writer waits and is then rejected. In autocommit the advance commits at
    once, which is what an external effect (a file, an API call) done right after needs.
    Returns the token accepted.
    """
    validate_name(resource)
    offer = fence_offer(fence)
    token = offer.token
    with connections[using].cursor() as cursor:
        cursor.execute(FENCE_SQL, [resource, token, *offer.params()])
        if cursor.fetchone() is not None:
            return token
        cursor.execute(FENCE_STORED_SQL, [resource])
        row = cursor.fetchone()
    from .models import Fence as FenceRow

    stored = None if row is None else int(row[0])
    if stored is None or stored <= token:
        through = revocation.revoked_through(offer, using)
        if through is not None:
            raise _revoked(FenceRow, resource, offer, through)
    raise _reject(FenceRow, resource, token, stored)


def _refuse_unfenced(model: type[models.Model], operation: str) -> None:
    if getattr(model, "require_fence", False):
        raise FenceRequired(model._meta.label, operation)


def _never_lower(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An unfenced ``update(fencing_token=x)`` may raise the stored token, never lower it.

    A lowered token would let a stale holder's writes through the fence again; the value
    (a number or an expression, e.g. ``bulk_update``'s ``Case``) becomes
    ``GREATEST(fencing_token, value)``.
    """
    if FENCE_TOKEN_FIELD not in kwargs:
        return kwargs
    value = kwargs[FENCE_TOKEN_FIELD]
    if not hasattr(value, "resolve_expression"):
        value = Value(value, output_field=models.BigIntegerField())
    return {**kwargs, FENCE_TOKEN_FIELD: Greatest(models.F(FENCE_TOKEN_FIELD), value)}


class FencedQuerySet(models.QuerySet[_M, _M]):
    """A queryset whose ``fenced(token)`` clones update only rows the token may write.

    Unfenced, it works as any queryset except that ``update(fencing_token=...)`` (and so
    ``bulk_update`` of that field) can only raise the stored token, and that a model with
    ``require_fence = True`` refuses unfenced ``update()``/``delete()``.

    Subclass it (or ``FencedManager.from_queryset``) to combine with your own queryset methods.
    """

    _fence: FenceLike | None = None

    def fenced(self, fence: FenceLike) -> Self:
        """A clone whose ``update()`` and ``bulk_update()`` carry ``fence``.

        All or nothing: if any row the queryset matches holds a token greater than ``fence``'s,
        nothing is changed and ``StaleFencingToken`` names those rows (``stored`` is the
        greatest of their tokens). Otherwise every matched row is updated and its
        ``fencing_token`` set to the token. A lease's ``ensure_held()`` runs at each update.

        Inside a savepoint, the matched rows are locked in primary-key order
        (``SELECT ... FOR UPDATE``) and then updated: two statements, so racing fenced writers
        over overlapping rows queue instead of deadlocking. A rejection costs the first only.
        """
        _valid_fence(fence)
        clone = self.all()
        clone._fence = fence
        return clone

    def _clone(self) -> Self:
        clone = super()._clone()  # type: ignore[misc]
        clone._fence = self._fence
        return clone  # type: ignore[no-any-return]

    def update(self, **kwargs: Any) -> int:
        if self._fence is None:
            _refuse_unfenced(self.model, "update()")
            return super().update(**_never_lower(kwargs))
        if FENCE_TOKEN_FIELD in kwargs:
            raise TypeError(f"a fenced update sets {FENCE_TOKEN_FIELD} itself; do not pass it")
        offer = fence_offer(self._fence)
        token = offer.token
        self._for_write = True  # the write alias, as Django's own update() uses
        with transaction.atomic(using=self.db):
            # Lock every matched row in primary-key order first: fenced writers racing over
            # overlapping rows then queue instead of deadlocking, and the tokens read are the
            # latest committed ones, so the decision below is final.
            locked = list(
                self.order_by("pk")
                .select_for_update(of=("self",))
                .values_list("pk", FENCE_TOKEN_FIELD)
            )
            stale = sorted((t, pk) for pk, t in locked if t > token)
            if stale:
                raise self._rejected(token, [(pk, t) for t, pk in reversed(stale)])
            pks = [pk for pk, _ in locked]
            rows = self._unrevoked(offer).filter(pk__in=pks, fencing_token__lte=token)
            updated = rows.update(**kwargs, **{FENCE_TOKEN_FIELD: token})
            if updated < len(pks):  # the rows are locked: only a revocation skips one
                raise self._revoked_or_stale(offer, pks)
            return updated

    update.alters_data = True  # type: ignore[attr-defined]

    def delete(self) -> tuple[int, dict[str, int]]:
        """Unfenced: Django's delete. Fenced: all or nothing, like a fenced ``update()``."""
        if self._fence is None:
            _refuse_unfenced(self.model, "delete()")
            return super().delete()
        offer = fence_offer(self._fence)
        self._for_write = True
        with transaction.atomic(using=self.db):
            locked = list(
                self.order_by("pk")
                .select_for_update(of=("self",))
                .values_list("pk", FENCE_TOKEN_FIELD)
            )
            stale = sorted((t, pk) for pk, t in locked if t > offer.token)
            if stale:
                raise self._rejected(offer.token, [(pk, t) for t, pk in reversed(stale)])
            pks = [pk for pk, _ in locked]
            deleted, per_model = self._unrevoked(offer).filter(pk__in=pks).delete()
            if per_model.get(self.model._meta.label, 0) < len(pks):
                raise self._revoked_or_stale(offer, pks)
            return deleted, per_model

    delete.alters_data = True  # type: ignore[attr-defined]
    delete.queryset_only = True  # type: ignore[attr-defined]

    def _unrevoked(self, offer: Offer) -> models.QuerySet[_M]:
        """The plain rows of this model, narrowed to "the offer's grant is not revoked".

        The condition is part of the writing statement itself, so a revocation committed before
        it runs is always seen.
        """
        rows = self.model._base_manager.using(self.db).all()
        if offer.revocable and revocation.checked_on(self.db):
            rows = rows.filter(revocation.not_revoked(offer))
        return rows

    def _revoked_or_stale(self, offer: Offer, pks: list[Any]) -> StaleFencingToken:
        through = revocation.revoked_through(offer, self.db)
        resource = f"{self.model._meta.label}(pk in {pks[:5]!r})"
        if through is not None:
            return _revoked(self.model, resource, offer, through)
        return _reject(self.model, resource, offer.token, None)

    def bulk_update(
        self, objs: Iterable[_M], fields: Iterable[str], batch_size: int | None = None
    ) -> int:
        if self._fence is None:
            _refuse_unfenced(self.model, "bulk_update()")  # before Django opens its savepoint
            return super().bulk_update(objs, fields, batch_size=batch_size)
        objs = sorted(objs, key=lambda obj: obj.pk)  # batches lock rows in ascending pk order
        fields = [f for f in fields if f != FENCE_TOKEN_FIELD]
        offer = fence_offer(self._fence)  # once: every batch carries the same checked offer
        self._for_write = True
        # One savepoint around every batch, so a stale batch also undoes the earlier ones.
        with transaction.atomic(using=self.db):
            count = super(FencedQuerySet, self.fenced(offer)).bulk_update(
                objs, fields, batch_size=batch_size
            )
        for obj in objs:
            setattr(obj, FENCE_TOKEN_FIELD, offer.token)
        return count

    bulk_update.alters_data = True  # type: ignore[attr-defined]

    def _rejected(self, token: int, stale: list[tuple[Any, int]]) -> StaleFencingToken:
        pks = ", ".join(repr(pk) for pk, _ in stale[:5]) + (", ..." if len(stale) > 5 else "")
        stored = max(t for _, t in stale)
        return _reject(self.model, f"{self.model._meta.label}(pk in [{pks}])", token, stored)


_FencedManagerBase = models.Manager.from_queryset(FencedQuerySet)


class FencedManager(_FencedManagerBase[_M]):
    """The default manager of :class:`FencedModel`: ``Model.objects.fenced(lease).update()``."""


class FencedModel(models.Model):
    """A model whose rows reject writes carrying a token lower than one already accepted.

    ``fencing_token`` is ``NOT NULL DEFAULT 0`` rather than nullable: ``fencing_token <= %s``
    is then a plain comparison (no ``COALESCE`` defeating an index, no NULL that silently
    rejects every write), adding the column to an existing table needs no backfill, and 0 is
    below every real token (tokens start at 1), so a never-fenced row accepts any lease.

    An unfenced ``save()`` works as always but never writes ``fencing_token`` on update (a
    stale in-memory copy must not lower the fence); named in ``update_fields`` it can only
    raise the stored token. No ORM path lowers it (``update()`` and ``bulk_update()`` neither).

    Set ``require_fence = True`` on a subclass to make every unfenced write to an existing row
    raise :class:`~leases.errors.FenceRequired` before reaching the database: ``save()`` of a
    stored row, ``delete()``, and the default manager's ``update()``/``bulk_update()``/
    ``delete()``. Creating new rows unfenced stays allowed. Raw SQL and other managers are, of
    course, beyond its reach.
    """

    fencing_token = models.BigIntegerField(default=0, editable=False)

    objects = FencedManager()

    #: Refuse unfenced writes to stored rows (see the class docstring).
    require_fence: bool = False

    #: Per-save state, set by ``save()`` only for the length of the call.
    _leases_fence: Offer | None = None
    _leases_force_insert: bool = False

    class Meta:
        abstract = True

    def save(self, *args: Any, fence: FenceLike | None = None, **kwargs: Any) -> None:
        """Save; with ``fence`` the write happens only if no greater token was accepted.

        An update is one ``UPDATE ... WHERE pk = %s AND fencing_token <= %s``; an insert with an
        explicit primary key is one ``INSERT ... ON CONFLICT (pk) DO UPDATE ... WHERE`` so two
        racing creators still end with the greater token's row. The stored token is read only
        after a rejection. Raises ``StaleFencingToken``, leaving the row and this instance's
        ``fencing_token`` unchanged and the caller's transaction usable.
        """
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        needed_rollback = connections[using].needs_rollback
        if fence is None:
            if not self._state.adding:
                _refuse_unfenced(type(self), "save()")
            try:
                super().save(*args, **kwargs)
            except FenceRequired:  # a new instance whose primary key is a stored row's
                self._keep_transaction_usable(using, needed_rollback)
                raise
            return
        offer = fence_offer(fence)
        token = offer.token
        update_fields = kwargs.get("update_fields")
        if update_fields is not None:
            kwargs["update_fields"] = {*update_fields, FENCE_TOKEN_FIELD}
        previous = self.fencing_token
        self.fencing_token = token
        self._leases_fence = offer
        self._leases_force_insert = bool(kwargs.get("force_insert"))
        guard: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if offer.revocable and revocation.checked_on(using):
            guard = connections[using].execute_wrapper(_InsertUnlessRevoked(self, offer, using))
        try:
            with guard:
                super().save(*args, **kwargs)
        except StaleFencingToken:
            self.fencing_token = previous
            self._keep_transaction_usable(using, needed_rollback)
            raise
        finally:
            del self._leases_fence, self._leases_force_insert

    save.alters_data = True  # type: ignore[attr-defined]

    def delete(
        self,
        using: str | None = None,
        keep_parents: bool = False,
        *,
        fence: FenceLike | None = None,
    ) -> tuple[int, dict[str, int]]:
        """Delete; with ``fence`` only if no greater token was accepted and it is not revoked."""
        if fence is None:
            _refuse_unfenced(type(self), "delete()")
            return super().delete(using=using, keep_parents=keep_parents)
        using = using or router.db_for_write(type(self), instance=self)
        rows: FencedQuerySet[Self] = FencedQuerySet(type(self), using=using).filter(pk=self.pk)
        return rows.fenced(fence_offer(fence)).delete()

    delete.alters_data = True  # type: ignore[attr-defined]

    async def asave(self, *args: Any, fence: FenceLike | None = None, **kwargs: Any) -> None:
        """Async ``save()``, fenced the same way (Django runs the save in a thread)."""
        await sync_to_async(self.save)(*args, fence=fence, **kwargs)

    asave.alters_data = True  # type: ignore[attr-defined]

    def _keep_transaction_usable(self, using: str, needed_rollback: bool) -> None:
        """Undo Django's "roll back on any error" mark when only our refusal happened.

        ``save_base`` marks an enclosing ``atomic`` block for rollback on any exception; a
        rejection ran no failing statement and changed nothing, so the caller may go on (and,
        say, record the rejection). With parent tables (multi-table inheritance) a parent may
        already have been written, so the mark stays.
        """
        connection = connections[using]
        if not self._meta.parents and connection.in_atomic_block and not needed_rollback:
            connection.needs_rollback = False

    def _resource(self) -> str:
        return f"{self._meta.label}(pk={self.pk!r})"

    def _do_update(
        self,
        base_qs: models.QuerySet[Any],
        using: str | None,
        pk_val: Any,
        values: Any,
        update_fields: Iterable[str] | None,
        forced_update: bool,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Django's UPDATE, narrowed to ``fencing_token <= token`` (how fsm-style mixins do it).

        Django 5.2 returns a bool, 6.0 the returned rows; either is falsy when no row matched.
        """
        update = super()._do_update
        rest = (using, pk_val, values, update_fields, forced_update, *args)
        if not _has_fence_column(base_qs.model):
            return update(base_qs, *rest, **kwargs)
        offer = self._leases_fence
        if offer is None:
            _refuse_unfenced(type(self), "save()")
            values = _unfenced_values(values, update_fields)
            return update(
                base_qs, using, pk_val, values, update_fields, forced_update, *args, **kwargs
            )
        token = offer.token
        fenced_qs = base_qs.filter(fencing_token__lte=token)
        if offer.revocable and using is not None and revocation.checked_on(using):
            fenced_qs = fenced_qs.filter(revocation.not_revoked(offer))
        for _ in range(_UPDATE_ATTEMPTS):
            updated = update(fenced_qs, *rest, **kwargs)
            if updated:
                return updated
            stored = base_qs.filter(pk=pk_val).values_list(FENCE_TOKEN_FIELD, flat=True).first()
            if stored is None:
                return updated  # no such row: Django goes on to the (fenced) insert
            if stored > token:
                break
            through = revocation.revoked_through(offer, using or DEFAULT_DB_ALIAS)
            if through is not None:
                raise _revoked(type(self), self._resource(), offer, through)
            # The row was created (committed) after the UPDATE took its snapshot and before
            # the read took its own: the UPDATE never saw it. Try again; the row is visible now.
        raise _reject(type(self), self._resource(), token, stored)

    def _do_insert(
        self,
        manager: models.Manager[Any],
        using: str,
        fields: list[Any],
        returning_fields: list[Any],
        raw: bool,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        meta = manager.model._meta
        if (
            self._leases_fence is None
            or self._leases_force_insert
            or raw
            or meta.pk not in fields
            or not _has_fence_column(manager.model)
        ):
            return super()._do_insert(  # type: ignore[misc]
                manager, using, fields, returning_fields, raw, *args, **kwargs
            )
        return self._fenced_upsert(manager, using, fields, returning_fields)

    def _fenced_upsert(
        self,
        manager: models.Manager[Any],
        using: str,
        fields: list[Any],
        returning_fields: list[Any],
    ) -> list[tuple[Any, ...]]:
        """``INSERT ... ON CONFLICT (pk) DO UPDATE ... WHERE stored <= offered RETURNING``.

        Django builds the insert and its conflict clause (so field preparation, ``pre_save``
        and expressions behave as in any save); only the fence condition is appended.
        """
        from django.db.models.sql.subqueries import InsertQuery

        meta = manager.model._meta
        connection = connections[using]
        qn = connection.ops.quote_name
        query: InsertQuery = InsertQuery(
            manager.model,
            on_conflict=OnConflict.UPDATE,
            update_fields=[f for f in fields if f is not meta.pk],
            unique_fields=[meta.pk],
        )
        query.insert_values(fields, [self])
        compiler = query.get_compiler(using=using)
        [(sql, params)] = compiler.as_sql()
        returning = returning_fields or [meta.pk]
        sql += UPSERT_FENCE_SQL.format(
            table=qn(meta.db_table),
            column=qn(FENCE_TOKEN_FIELD),
            returning=", ".join(f"{qn(meta.db_table)}.{qn(f.column)}" for f in returning),
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is None:
            token = int(self.fencing_token)
            stored = (
                manager.using(using)
                .filter(pk=self.pk)
                .values_list(FENCE_TOKEN_FIELD, flat=True)
                .first()
            )
            raise _reject(type(self), self._resource(), token, stored)
        if not returning_fields:
            return []
        cols = [f.get_col(meta.db_table) for f in returning_fields]
        rows: list[Any] = [row]
        converters = compiler.get_converters(cols)
        if converters:
            rows = list(compiler.apply_converters(rows, converters))
        return [tuple(r) for r in rows]


def _unfenced_values(values: Any, update_fields: Iterable[str] | None) -> list[Any]:
    """An unfenced save never lowers the stored token (see :func:`_never_lower`).

    Without ``update_fields`` the in-memory token (perhaps stale) is not written at all; named
    in ``update_fields`` it is written as ``GREATEST(stored, value)``.
    """
    if FENCE_TOKEN_FIELD not in (update_fields or ()):
        return [v for v in values if v[0].attname != FENCE_TOKEN_FIELD]
    return [
        (field, model, _never_lower({FENCE_TOKEN_FIELD: value})[FENCE_TOKEN_FIELD])
        if field.attname == FENCE_TOKEN_FIELD
        else (field, model, value)
        for field, model, value in values
    ]


class _InsertUnlessRevoked:
    """Rewrites the fenced save's one-row ``INSERT ... VALUES (...)`` into ``INSERT ... SELECT
    ... WHERE NOT EXISTS (revocation)``, through Django's ``execute_wrapper``.

    So an insert (auto primary key, the fenced upsert, a multi-table parent's row) refuses a
    revoked grant in the very statement that writes, while Django still builds the statement
    and reads back what it returns. A revoked grant inserts nothing; the wrapper then raises
    :class:`~leases.errors.FencingTokenRevoked` (an empty upsert that was not revoked is a
    stale token, which the upsert itself reports).
    """

    def __init__(self, instance: FencedModel, offer: Offer, using: str) -> None:
        self.instance = instance
        self.offer = offer
        self.using = using

    def __call__(
        self, execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]
    ) -> Any:
        rewritten = None if many else _insert_select(sql)
        if rewritten is None:
            return execute(sql, params, many, context)
        sql, placeholders = rewritten
        params = [*params[:placeholders], *self.offer.params(), *params[placeholders:]]
        result = execute(sql, params, many, context)
        if context["cursor"].rowcount == 0:
            through = revocation.revoked_through(self.offer, self.using)
            if through is not None:
                model = type(self.instance)
                raise _revoked(model, self.instance._resource(), self.offer, through)
        return result


def _insert_select(sql: str) -> tuple[str, int] | None:
    """``(the INSERT as INSERT ... SELECT ... WHERE not revoked, parameters before the
    condition)`` for a one-row ``INSERT ... VALUES (...)``; ``None`` for any other statement."""
    head, found, rest = sql.partition(" VALUES (")
    if not found or not head.startswith("INSERT INTO "):
        return None
    end = _closing_parenthesis(rest)
    if end is None:
        return None
    values, tail = rest[:end], rest[end + 1 :]
    if tail.lstrip().startswith(","):  # several rows: not a save's insert
        return None
    placeholders = sum(1 for found in _PLACEHOLDER.findall(values) if found == "%s")
    return f"{head} SELECT {values} WHERE {NOT_REVOKED_SQL}{tail}", placeholders


def _closing_parenthesis(text: str) -> int | None:
    """Index of the ``)`` that closes a ``(`` just before ``text`` starts."""
    depth = 1
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return index
    return None
