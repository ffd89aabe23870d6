"""``FencedModel``: rows that refuse a write carrying a token lower than one they accepted.

Django builds every statement (so field preparation, ``pre_save`` and expressions behave as in
any save); the fence narrows the UPDATE, adds a conflict condition to the upsert, and turns a
one-row INSERT into an INSERT ... SELECT that a revoked grant cannot pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, models, router
from django.db.models.constants import OnConflict

from .. import revocation
from ..errors import FenceRequired, LeaseCheckFailed, StaleFencingToken
from ..revocation import Offer
from .checked import LeaseCheck, lease_check
from .guarded_insert import InsertUnless
from .queryset import FencedManager, FencedQuerySet, never_lower, refuse_unfenced
from .tokens import (
    FENCE_TOKEN_FIELD,
    FenceHolder,
    FenceLike,
    fence_offer,
    has_fence_column,
    reject,
    revoked,
    row_resource,
)

if TYPE_CHECKING:
    from django.db.models.sql.subqueries import InsertQuery

__all__ = ["UPSERT_FENCE_SQL", "FencedModel"]

#: A fenced UPDATE can miss a row another transaction committed while it ran (READ COMMITTED
#: snapshot); the retry sees it. Two tries always decide; the third is slack.
_UPDATE_ATTEMPTS = 3
#: Appended to Django's ``INSERT ... ON CONFLICT (pk) DO UPDATE SET ...`` for a fenced insert.
UPSERT_FENCE_SQL = " WHERE {table}.{column} <= EXCLUDED.{column} RETURNING {returning}"


class FencedModel(models.Model):
    """A model whose rows reject writes carrying a token lower than one already accepted.

    ``fencing_token`` is ``NOT NULL DEFAULT 0`` rather than nullable: ``fencing_token <= %s``
    is then a plain comparison (no ``COALESCE`` defeating an index, no NULL that silently
    rejects every write), adding the column to an existing table needs no backfill, and 0 is
    below every real token (tokens start at 1), so a never-fenced row accepts any lease.

    An unfenced ``save()`` works as always but never writes ``fencing_token`` on update (a
    stale in-memory copy must not lower the fence); named in ``update_fields`` it can only
    raise the stored token. No ORM path lowers it (``update()`` and ``bulk_update()`` neither;
    an upserting ``bulk_create()`` may not name it in ``update_fields``).

    Set ``require_fence = True`` on a subclass to make every unfenced write to an existing row
    raise :class:`~leases.errors.FenceRequired` before reaching the database: ``save()`` of a
    stored row, ``delete()``, and the default manager's ``update()``/``bulk_update()``/
    ``delete()`` and upserting ``bulk_create()``. Creating new rows unfenced stays allowed.
    Raw SQL and other managers are, of course, beyond its reach.
    """

    fencing_token = models.BigIntegerField(default=0, editable=False)

    objects = FencedManager()

    #: Refuse unfenced writes to stored rows (see the class docstring).
    require_fence: bool = False

    #: Per-save state, set by ``save()`` only for the length of the call.
    _leases_fence: Offer | None = None
    _leases_force_insert: bool = False
    _leases_check: LeaseCheck | None = None

    class Meta:
        abstract = True

    def save(
        self,
        *args: Any,
        fence: FenceLike | None = None,
        lease: FenceHolder | None = None,
        **kwargs: Any,
    ) -> None:
        """Save; with ``fence`` the write happens only if no greater token was accepted.

        With ``lease`` (a held :class:`~leases.lease.Lease` of a backend whose lease rows are in
        this database) the writing statement also checks that the lease is still this grant and
        unexpired by the database clock (:mod:`.checked`), else raises
        :class:`~leases.errors.LeaseCheckFailed` and writes nothing. Both may be given.

        An update is one ``UPDATE ... WHERE pk = %s AND fencing_token <= %s``; an insert with an
        explicit primary key is one ``INSERT ... ON CONFLICT (pk) DO UPDATE ... WHERE`` so two
        racing creators still end with the greater token's row. The stored token is read only
        after a rejection. Raises ``StaleFencingToken``, leaving the row and this instance's
        ``fencing_token`` unchanged and the caller's transaction usable, except under
        multi-table inheritance: a parent's row may have been written before the refusal, so
        the enclosing ``atomic()`` block is marked to roll back, as for any failed save.
        """
        if args and (fence is not None or lease is not None):
            # Django 5.2 still takes save()'s arguments positionally (deprecated); the fence
            # must see update_fields and using to add the token and judge the right database.
            raise TypeError("a fenced save() takes its other arguments by keyword only")
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        needed_rollback = connections[using].needs_rollback
        check = None if lease is None else lease_check(lease, using)
        if fence is None and check is None:
            if not self._state.adding:
                refuse_unfenced(type(self), "save()")
            try:
                super().save(*args, **kwargs)
            except FenceRequired:  # a new instance whose primary key is a stored row's
                self._keep_transaction_usable(using, needed_rollback)
                raise
            return
        offer = None if fence is None else fence_offer(fence)
        previous = self.fencing_token
        update_fields = kwargs.get("update_fields")
        if update_fields is not None and not update_fields:
            return  # Django's no-op: nothing to write, so nothing to fence
        if offer is not None:
            if update_fields is not None:
                kwargs["update_fields"] = {*update_fields, FENCE_TOKEN_FIELD}
            self.fencing_token = offer.token
        self._leases_fence = offer
        self._leases_check = check
        self._leases_force_insert = bool(kwargs.get("force_insert"))
        guard: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if offer is not None and not (offer.revocable and revocation.checked_on(using)):
            offer_checked: Offer | None = None
        else:
            offer_checked = offer
        if offer_checked is not None or check is not None:
            wrapper = InsertUnless(self, using, offer_checked, check)
            guard = connections[using].execute_wrapper(wrapper)
        try:
            with guard:
                super().save(*args, **kwargs)
        except (StaleFencingToken, LeaseCheckFailed):
            self.fencing_token = previous
            self._keep_transaction_usable(using, needed_rollback)
            raise
        finally:
            del self._leases_fence, self._leases_check, self._leases_force_insert

    save.alters_data = True  # type: ignore[attr-defined]

    def delete(
        self,
        using: str | None = None,
        keep_parents: bool = False,
        *,
        fence: FenceLike | None = None,
    ) -> tuple[int, dict[str, int]]:
        """Delete; with ``fence`` only if no greater token was accepted and it is not revoked.

        Fenced, it is the fenced queryset delete of this row (all its tables, cascades
        included), so ``keep_parents`` is refused rather than ignored; as Django's, it refuses
        an unsaved instance and forgets the primary key of the one it deleted."""
        if fence is None:
            refuse_unfenced(type(self), "delete()")
            return super().delete(using=using, keep_parents=keep_parents)
        if keep_parents:
            raise TypeError("a fenced delete() deletes the parents' rows too: no keep_parents")
        if self.pk is None:
            raise ValueError(
                f"{self._meta.object_name} object can't be deleted because its "
                f"{self._meta.pk.attname} attribute is set to None."
            )
        valid = fence_offer(fence)
        using = using or router.db_for_write(type(self), instance=self)
        rows: FencedQuerySet[Self] = FencedQuerySet(type(self), using=using).filter(pk=self.pk)
        deleted = rows.fenced(valid).delete()
        setattr(self, self._meta.pk.attname, None)
        return deleted

    delete.alters_data = True  # type: ignore[attr-defined]

    async def adelete(
        self,
        using: str | None = None,
        keep_parents: bool = False,
        *,
        fence: FenceLike | None = None,
    ) -> tuple[int, dict[str, int]]:
        """Async ``delete()``, fenced the same way (Django runs the delete in a thread)."""
        return await sync_to_async(self.delete)(using, keep_parents, fence=fence)

    adelete.alters_data = True  # type: ignore[attr-defined]

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
        """Django's UPDATE, narrowed by the lease check (``save(lease=...)``) and the fence.

        Every UPDATE a save runs (a multi-table parent's too) comes through here. A checked
        UPDATE that changed nothing asks whether the lease was the reason (one more statement,
        only then); if the lease still holds, there is no such row and Django inserts.
        """
        check = self._leases_check
        rest = (using, pk_val, values, update_fields, forced_update, *args)
        if check is None:
            return self._fenced_update(base_qs, *rest, **kwargs)
        updated = self._fenced_update(base_qs.filter(check.condition()), *rest, **kwargs)
        if not updated and not check.holds(using or DEFAULT_DB_ALIAS):
            raise check.refused(row_resource(self))
        return updated

    def _fenced_update(
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
        if not has_fence_column(base_qs.model):
            return update(base_qs, *rest, **kwargs)
        offer = self._leases_fence
        if offer is None:
            if self._state.adding and not base_qs.filter(pk=pk_val).exists():
                return 0  # a new row with a key of its own: creating stays allowed, unfenced
            refuse_unfenced(type(self), "save()")
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
                raise revoked(type(self), row_resource(self), offer, through)
            # The row was created (committed) after the UPDATE took its snapshot and before
            # the read took its own: the UPDATE never saw it. Try again; the row is visible now.
        raise reject(type(self), row_resource(self), token, stored)

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
        keyed = all(f in fields for f in meta.pk_fields)  # a composite key's columns too
        if self._leases_fence is None or self._leases_force_insert or raw or not keyed:
            return super()._do_insert(  # type: ignore[misc]
                manager, using, fields, returning_fields, raw, *args, **kwargs
            )
        if has_fence_column(manager.model):
            return self._fenced_upsert(manager, using, fields, returning_fields)
        # Another table of this model's multi-table chain, above or below the token's: every
        # one of them is upserted, unfenced (see _upsert).
        return self._upsert(manager, using, fields, returning_fields, fenced=False)

    def _fenced_upsert(
        self,
        manager: models.Manager[Any],
        using: str,
        fields: list[Any],
        returning_fields: list[Any],
    ) -> list[tuple[Any, ...]]:
        """``INSERT ... ON CONFLICT (pk) DO UPDATE ... WHERE stored <= offered RETURNING``."""
        return self._upsert(manager, using, fields, returning_fields, fenced=True)

    def _upsert(
        self,
        manager: models.Manager[Any],
        using: str,
        fields: list[Any],
        returning_fields: list[Any],
        *,
        fenced: bool,
    ) -> list[tuple[Any, ...]]:
        """``INSERT ... ON CONFLICT (pk) DO UPDATE ... RETURNING``, with the fence condition
        when ``fenced`` (the table that holds the token).

        Django builds the insert and its conflict clause (so field preparation, ``pre_save``
        and expressions behave as in any save); only the fence condition is appended. The
        chain's other tables (``fenced`` false) are upserted too, since a creator racing ours
        may have inserted their row first. Below the token's (a child's table), the fenced
        upsert of the token's table ran first in this save's transaction, keeps its row locked
        and has decided already. Above it (``class Order(FencedModel, Base)``: ``Base``'s row
        is written first), the fenced upsert comes later in the same transaction and decides;
        a refusal there fails the save, whose transaction then rolls this row back with it.
        """
        from django.db.models.sql.subqueries import InsertQuery

        meta = manager.model._meta
        connection = connections[using]
        qn = connection.ops.quote_name
        keys = list(meta.pk_fields)
        updated = [f for f in fields if f not in keys]
        query: InsertQuery = InsertQuery(
            manager.model,
            on_conflict=OnConflict.UPDATE if updated else OnConflict.IGNORE,
            update_fields=updated,
            unique_fields=keys,
        )
        query.insert_values(fields, [self])
        compiler = query.get_compiler(using=using)
        [(sql, params)] = compiler.as_sql()
        returning = returning_fields or keys
        columns = ", ".join(f"{qn(meta.db_table)}.{qn(f.column)}" for f in returning)
        if fenced:
            column = qn(meta.get_field(FENCE_TOKEN_FIELD).column)
            sql += UPSERT_FENCE_SQL.format(
                table=qn(meta.db_table), column=column, returning=columns
            )
        else:
            sql += f" RETURNING {columns}"
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is None and not fenced:  # ON CONFLICT DO NOTHING: a table of the key alone
            row = tuple(getattr(self, f.attname) for f in returning)
        if row is None:
            token = int(self.fencing_token)
            stored = (
                manager.using(using)
                .filter(pk=self.pk)
                .values_list(FENCE_TOKEN_FIELD, flat=True)
                .first()
            )
            raise reject(type(self), row_resource(self), token, stored)
        if not returning_fields:
            return []
        cols = [f.get_col(meta.db_table) for f in returning_fields]
        rows: list[Any] = [row]
        converters = compiler.get_converters(cols)
        if converters:
            rows = list(compiler.apply_converters(rows, converters))
        return [tuple(r) for r in rows]


def _unfenced_values(values: Any, update_fields: Iterable[str] | None) -> list[Any]:
    """An unfenced save never lowers the stored token (see :func:`never_lower`).

    Without ``update_fields`` the in-memory token (perhaps stale) is not written at all; named
    in ``update_fields`` it is written as ``GREATEST(stored, value)``.
    """
    if FENCE_TOKEN_FIELD not in (update_fields or ()):
        return [v for v in values if v[0].attname != FENCE_TOKEN_FIELD]
    return [
        (field, model, never_lower({FENCE_TOKEN_FIELD: value})[FENCE_TOKEN_FIELD])
        if field.attname == FENCE_TOKEN_FIELD
        else (field, model, value)
        for field, model, value in values
    ]
