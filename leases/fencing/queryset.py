"""``FencedQuerySet``: fenced ``update()``, ``bulk_update()`` and ``delete()``, all or nothing.

Unfenced, it is Django's queryset except that nothing lowers a stored token and a model with
``require_fence`` refuses unfenced writes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, Self, TypeVar

from django.db import NotSupportedError, models, transaction
from django.db.models.expressions import Value
from django.db.models.functions import Greatest

from .. import revocation
from ..errors import FenceRequired, InvalidLeaseOption, LeaseError, StaleFencingToken
from ..revocation import Offer
from .checked import LeaseCheck, lease_check
from .tokens import (
    FENCE_TOKEN_FIELD,
    FenceHolder,
    FenceLike,
    fence_offer,
    reject,
    revoked,
    token_owner,
    valid_fence,
)

__all__ = ["FencedManager", "FencedQuerySet", "never_lower", "refuse_unfenced"]

_M = TypeVar("_M", bound=models.Model)


def refuse_unfenced(model: type[models.Model], operation: str) -> None:
    if getattr(model, "require_fence", False):
        raise FenceRequired(model._meta.label, operation)


def never_lower(kwargs: dict[str, Any]) -> dict[str, Any]:
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


def token_table(model: type[models.Model]) -> str:
    """What ``select_for_update(of=...)`` names to lock the rows that hold ``model``'s token:
    ``"self"``, or under multi-table inheritance the path of parent links to the ancestor
    whose table has the column (``"fenceddoc_ptr"``). Locking the child's rows alone let a
    fenced write read a token that a concurrent fenced save of the parent was replacing, and
    then write over it."""
    owner = token_owner(model)
    current, path = model._meta.concrete_model, []
    while owner is not None and current is not None and current is not owner:
        for parent, link in current._meta.parents.items():
            if link is not None and issubclass(parent, owner):
                path.append(link.name)
                current = parent._meta.concrete_model
                break
        else:  # pragma: no cover - the field is this model's or an ancestor's
            return "self"
    return "__".join(path) or "self"


def locked_before_the_token(model: type[models.Model]) -> list[type[models.Model]]:
    """The tables a save writes before the one that holds ``model``'s token: the token
    owner's multi-table ancestors, root first. A fenced write locks their rows first, in
    that order, then the token's (:func:`token_table`), the order a save writes them in, so
    the two queue instead of deadlocking. With the token below a plain parent (``class
    Order(FencedModel, Base)``), locking the token's table first did deadlock against a save
    that had written ``Base``'s row and waited for ``Order``'s."""
    owner = token_owner(model)
    return [] if owner is None else list(reversed(owner._meta.get_parent_list()))


class FencedQuerySet(models.QuerySet[_M, _M]):
    """A queryset whose ``fenced(token)`` clones update only rows the token may write.

    Unfenced, it works as any queryset except that ``update(fencing_token=...)`` (and so
    ``bulk_update`` of that field) can only raise the stored token, and that a model with
    ``require_fence = True`` refuses unfenced ``update()``/``delete()``.

    Subclass it (or ``FencedManager.from_queryset``) to combine with your own queryset methods.
    """

    _fence: FenceLike | None = None
    _lease: FenceHolder | None = None
    #: Set while an ``under_lease()`` update runs: every writing statement carries it.
    _lease_check: LeaseCheck | None = None

    def under_lease(self, held: FenceHolder) -> Self:
        """A clone whose ``update()``, ``bulk_update()`` and ``delete()`` write only while
        ``held`` is held.

        The UPDATE (or DELETE) itself checks that the lease row is still this grant and
        unexpired by the database clock (:mod:`.checked`): a lease that expired writes nothing
        and raises :class:`~leases.errors.LeaseCheckFailed`, even if no one else has taken it.
        Needs a backend whose lease rows are in this database
        (:class:`~leases.errors.LeaseCheckUnavailable` otherwise). Combines with ``fenced()``.
        """
        if not isinstance(held, FenceHolder):
            raise InvalidLeaseOption("lease", held, "must be a Lease (from acquire() or lease())")
        clone = self.all()
        clone._lease = held
        return clone

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
        valid_fence(fence)
        clone = self.all()
        clone._fence = fence
        return clone

    def _clone(self) -> Self:
        clone = super()._clone()  # type: ignore[misc]
        clone._fence = self._fence
        clone._lease = self._lease
        clone._lease_check = self._lease_check
        return clone  # type: ignore[no-any-return]

    def update(self, **kwargs: Any) -> int:
        if self._lease is not None:
            return self._checked_update(self._lease, kwargs)
        if self._fence is None:
            refuse_unfenced(self.model, "update()")
            return super().update(**never_lower(kwargs))
        if FENCE_TOKEN_FIELD in kwargs:
            raise TypeError(f"a fenced update sets {FENCE_TOKEN_FIELD} itself; do not pass it")
        self._refuse_as_django_would("update")
        offer = fence_offer(self._fence)
        token = offer.token
        self._for_write = True  # the write alias, as Django's own update() uses
        with transaction.atomic(using=self.db):
            locked = self._lock_matched()
            stale = sorted((t, pk) for pk, t in locked if t > token)
            if stale:
                raise self._rejected(token, [(pk, t) for t, pk in reversed(stale)])
            pks = [pk for pk, _ in locked]
            rows = self._unrevoked(offer, self._updating()).filter(
                pk__in=pks, fencing_token__lte=token
            )
            updated = rows.update(**kwargs, **{FENCE_TOKEN_FIELD: token})
            if updated < len(pks):  # the rows are locked: only a revocation skips one
                raise self._revoked_or_stale(offer, pks)
            return updated

    update.alters_data = True  # type: ignore[attr-defined]

    def _refuse_as_django_would(self, operation: str) -> None:
        """A fenced write refuses the querysets Django's own refuses, in its words, before any
        query: the fenced path locks rows by primary key from the queryset as a subquery,
        which would otherwise quietly write a slice or a union."""
        if self.query.combinator:
            raise NotSupportedError(
                f"Calling QuerySet.{operation}() after {self.query.combinator}() is not supported."
            )
        if self.query.is_sliced:
            if operation == "delete":
                raise TypeError("Cannot use 'limit' or 'offset' with delete().")
            raise TypeError("Cannot update a query once a slice has been taken.")
        if operation == "delete" and self.query.distinct_fields:
            raise TypeError("Cannot call delete() after .distinct(*fields).")
        if operation == "delete" and getattr(self, "_fields", None) is not None:
            raise TypeError("Cannot call delete() after .values() or .values_list()")

    def _lock_matched(self) -> list[tuple[Any, int]]:
        """Lock every row this queryset matches, in primary-key order, and read their tokens.

        Fenced writers racing over overlapping rows then queue instead of deadlocking, and the
        tokens read are the latest committed ones, so the decision taken on them is final.

        The rows are locked by primary key, the queryset a subquery, rather than by the
        queryset itself: PostgreSQL refuses ``FOR UPDATE`` beside ``DISTINCT`` or ``GROUP BY``
        (a ``distinct()``, an aggregate annotation), a filter through a multi-valued relation
        matches a row once per related row (each counted as a row not written), and
        ``FOR UPDATE OF`` wants a table's unqualified name, which a ``db_table`` in another
        schema does not give. The locking query reads the model's table alone (joined to its
        parents under multi-table inheritance, of which only the token's table is locked:
        :func:`token_table`), after the rows of the tables a save writes first
        (:func:`locked_before_the_token`). As in Django's own updates through a subquery, a
        matched row that a concurrent write changes while this waits for its lock stays
        matched; its token is read after that write, which is what the fence decides on.
        """
        keys = self.values("pk")
        for ancestor in locked_before_the_token(self.model):
            rows: models.QuerySet[Any] = models.QuerySet(ancestor, using=self.db)
            rows = rows.filter(pk__in=keys)
            list(rows.order_by("pk").select_for_update().values_list("pk"))
        matched = self._plain().filter(pk__in=keys).order_by("pk")
        table = token_table(self.model)
        locking = matched.select_for_update(of=(table,) if table != "self" else ())
        return list(locking.values_list("pk", FENCE_TOKEN_FIELD))

    def _plain(self) -> models.QuerySet[_M]:
        """Django's own queryset of this model's rows, every one: what the fenced paths write
        and lock through once they decided. Not the base manager's, which a model may have
        made a ``FencedManager`` (whose unfenced writes a ``require_fence`` model refuses) or
        a filtering one (whose writes skip rows the fenced queryset matched)."""
        return models.QuerySet(self.model, using=self.db)

    def _checked_update(self, held: FenceHolder, kwargs: dict[str, Any]) -> int:
        """``update()`` with the lease check in every statement that selects or writes rows.

        An update that changed nothing asks whether the lease was the reason (one more
        statement, only then): no matching rows with the lease held is simply 0.
        """
        self._for_write = True
        check = lease_check(held, self.db)
        rows = self.filter(check.condition())
        rows._lease, rows._lease_check = None, check
        updated = rows.update(**kwargs)
        if not updated and not check.holds(self.db):
            raise check.refused(f"{self.model._meta.label}(under lease {check.name!r})")
        return updated

    def delete(self) -> tuple[int, dict[str, int]]:
        """Unfenced: Django's delete. Fenced: all or nothing, like a fenced ``update()``.
        Under a lease: only while the lease is held, like a lease-checked ``update()``."""
        if self._lease is not None:
            return self._checked_delete(self._lease)
        if self._fence is None:
            refuse_unfenced(self.model, "delete()")
            return super().delete()
        self._refuse_as_django_would("delete")
        offer = fence_offer(self._fence)
        self._for_write = True
        with transaction.atomic(using=self.db):
            locked = self._lock_matched()
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

    def _checked_delete(self, held: FenceHolder) -> tuple[int, dict[str, int]]:
        """``delete()`` with the lease check in the statement that selects the rows (a fast
        delete's one ``DELETE``, else the collector's ``SELECT``), and once more after the last
        deleting statement, inside one savepoint.

        Django deletes related rows (cascades) and then the rows themselves by primary key, in
        statements that cannot carry the check; every one of them runs between two statements
        that found the lease held, and a lease lost meanwhile undoes them all
        (:class:`~leases.errors.LeaseCheckFailed`, nothing deleted). The final check costs one
        statement on every call, unlike an update's (asked only when nothing changed): a
        cascading delete is several statements, not one. No matching rows with the lease held
        is simply 0.
        """
        self._for_write = True
        check = lease_check(held, self.db)
        with transaction.atomic(using=self.db):
            rows = self.filter(check.condition())
            rows._lease, rows._lease_check = None, check
            deleted, per_model = rows.delete()
            if not check.holds(self.db):
                raise check.refused(f"{self.model._meta.label}(under lease {check.name!r})")
        return deleted, per_model

    def _updating(self) -> models.QuerySet[_M]:
        """What a decided fenced ``update()`` writes through, narrowed to the locked rows by its
        caller: this queryset's own annotations kept (``update(body=F("x"))`` may read one), in
        Django's plain queryset; :meth:`_plain` when one aggregates or the rows are
        ``distinct()`` (Django's ``UPDATE`` cannot group; the rows are the locked keys)."""
        annotations = self.query.annotations.values()
        grouped = any(getattr(a, "contains_aggregate", False) for a in annotations)
        if not annotations or grouped or self.query.distinct:
            return self._plain()
        return models.QuerySet(self.model, query=self.query.chain(), using=self.db)

    def _unrevoked(
        self, offer: Offer, rows: models.QuerySet[_M] | None = None
    ) -> models.QuerySet[_M]:
        """``rows`` (every row of this model: :meth:`_plain`), narrowed to "the offer's grant
        is not revoked".

        The condition is part of the writing statement itself, so a revocation committed before
        it runs is always seen.
        """
        rows = self._plain() if rows is None else rows
        if offer.revocable and revocation.checked_on(self.db):
            rows = rows.filter(revocation.not_revoked(offer))
        if self._lease_check is not None:
            rows = rows.filter(self._lease_check.condition())
        return rows

    def _revoked_or_stale(self, offer: Offer, pks: list[Any]) -> LeaseError:
        resource = f"{self.model._meta.label}(pk in {pks[:5]!r})"
        check = self._lease_check
        if check is not None and not check.holds(self.db):
            return check.refused(resource)
        through = revocation.revoked_through(offer, self.db)
        if through is not None:
            return revoked(self.model, resource, offer, through)
        return reject(self.model, resource, offer.token, None)

    def _refuse_fenced(self, operation: str) -> None:
        """A fence or lease applies to ``update()``, ``bulk_update()`` and ``delete()``; any
        other write of a fenced queryset would read as fenced and write unfenced (a stale
        holder's ``update_or_create`` over the successor's row, without a word)."""
        if self._fence is not None or self._lease is not None:
            raise TypeError(
                f"{operation} does not take the fence of a fenced() or under_lease() queryset: "
                "save instances with save(fence=...) / save(lease=...), or write with the "
                "fenced queryset's update(), bulk_update() or delete()"
            )

    def create(self, **kwargs: Any) -> _M:
        self._refuse_fenced("create()")
        return super().create(**kwargs)

    def get_or_create(self, defaults: Any = None, **kwargs: Any) -> tuple[_M, bool]:
        self._refuse_fenced("get_or_create()")
        return super().get_or_create(defaults, **kwargs)

    def update_or_create(
        self, defaults: Any = None, create_defaults: Any = None, **kwargs: Any
    ) -> tuple[_M, bool]:
        self._refuse_fenced("update_or_create()")
        return super().update_or_create(defaults, create_defaults, **kwargs)

    def bulk_create(
        self,
        objs: Iterable[_M],
        batch_size: int | None = None,
        ignore_conflicts: bool = False,
        update_conflicts: bool = False,
        update_fields: Collection[str] | None = None,
        unique_fields: Collection[str] | None = None,
    ) -> list[_M]:
        """Django's ``bulk_create``; an upserting one (``update_conflicts=True``) writes stored
        rows unfenced, so a model with ``require_fence`` refuses it, and it may not name
        ``fencing_token`` among its ``update_fields``: ``ON CONFLICT DO UPDATE`` sets a field
        to the new row's value and cannot say ``GREATEST``, so it could lower the token (and a
        stale holder would pass the fence again). Creating rows stays allowed."""
        self._refuse_fenced("bulk_create()")
        if update_conflicts:
            refuse_unfenced(self.model, "bulk_create(update_conflicts=True)")
            if FENCE_TOKEN_FIELD in (update_fields or ()):
                field = FENCE_TOKEN_FIELD
                raise TypeError(
                    f"an upserting bulk_create() may not write {field}: it would take the new "
                    "row's value, lower or not; leave it out of update_fields (a fenced write "
                    "raises it)"
                )
        return super().bulk_create(
            objs,
            batch_size=batch_size,
            ignore_conflicts=ignore_conflicts,
            update_conflicts=update_conflicts,
            update_fields=update_fields,
            unique_fields=unique_fields,
        )

    bulk_create.alters_data = True  # type: ignore[attr-defined]

    def bulk_update(
        self, objs: Iterable[_M], fields: Iterable[str], batch_size: int | None = None
    ) -> int:
        if self._fence is None:
            refuse_unfenced(self.model, "bulk_update()")  # before Django opens its savepoint
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
        return reject(self.model, f"{self.model._meta.label}(pk in [{pks}])", token, stored)


_FencedManagerBase = models.Manager.from_queryset(FencedQuerySet)


class FencedManager(_FencedManagerBase[_M]):
    """The default manager of :class:`FencedModel`: ``Model.objects.fenced(lease).update()``."""
