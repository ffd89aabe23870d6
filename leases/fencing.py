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

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeAlias, TypeVar, runtime_checkable

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models.constants import OnConflict

from . import signals
from .errors import InvalidFencingToken, StaleFencingToken
from .keys import validate_name

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
    "fence_token",
]

logger = logging.getLogger(__name__)
_M = TypeVar("_M", bound=models.Model)

FENCE_TOKEN_FIELD = "fencing_token"  # noqa: S105 (a column name, not a secret)
_INT64_MAX = 2**63 - 1
#: A fenced UPDATE can miss a row another transaction committed while it ran (READ COMMITTED
#: snapshot); the retry sees it. Two tries always decide; the third is slack.
_UPDATE_ATTEMPTS = 3

#: check_fence's one statement: insert the first token or advance to a token not lower than the
#: stored one; no row comes back when the stored token is greater (the write is stale).
FENCE_SQL = (
    "INSERT INTO leases_fence (resource, token) VALUES (%s, %s) "
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


def fence_token(fence: FenceLike) -> int:
    """The token to write with, failing fast if a lease already knows it was lost.

    A holder whose keepalive saw the loss (or whose validity ran out) raises ``LeaseLost`` here
    even when nobody newer has written yet: the database fence alone could not tell
    (DESIGN invariant 5).
    """
    if isinstance(fence, int):
        return _valid_token(fence)
    if not isinstance(fence, FenceHolder):
        raise InvalidFencingToken(
            fence, f"must be an int or a lease (token + ensure_held), not {type(fence).__name__}"
        )
    fence.ensure_held()
    return _valid_token(fence.token)


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
    token = fence_token(fence)
    with connections[using].cursor() as cursor:
        cursor.execute(FENCE_SQL, [resource, token])
        if cursor.fetchone() is not None:
            return token
        cursor.execute(FENCE_STORED_SQL, [resource])
        row = cursor.fetchone()
    from .models import Fence as FenceRow

    raise _reject(FenceRow, resource, token, None if row is None else int(row[0]))


class FencedQuerySet(models.QuerySet[_M, _M]):
    """A queryset whose ``fenced(token)`` clones update only rows the token may write.

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
        if isinstance(fence, int):
            _valid_token(fence)
        clone = self.all()
        clone._fence = fence
        return clone

    def _clone(self) -> Self:
        clone = super()._clone()  # type: ignore[misc]
        clone._fence = self._fence
        return clone  # type: ignore[no-any-return]

    def update(self, **kwargs: Any) -> int:
        if self._fence is None:
            return super().update(**kwargs)
        if FENCE_TOKEN_FIELD in kwargs:
            raise TypeError(f"a fenced update sets {FENCE_TOKEN_FIELD} itself; do not pass it")
        token = fence_token(self._fence)
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
            rows = self.model._base_manager.using(self.db).filter(
                pk__in=pks, fencing_token__lte=token
            )
            return rows.update(**kwargs, **{FENCE_TOKEN_FIELD: token})

    update.alters_data = True  # type: ignore[attr-defined]

    def bulk_update(
        self, objs: Iterable[_M], fields: Iterable[str], batch_size: int | None = None
    ) -> int:
        if self._fence is None:
            return super().bulk_update(objs, fields, batch_size=batch_size)
        objs = sorted(objs, key=lambda obj: obj.pk)  # batches lock rows in ascending pk order
        fields = [f for f in fields if f != FENCE_TOKEN_FIELD]
        token = fence_token(self._fence)  # once: every batch carries the same token
        # One savepoint around every batch, so a stale batch also undoes the earlier ones.
        with transaction.atomic(using=self.db):
            count = super(FencedQuerySet, self.fenced(token)).bulk_update(
                objs, fields, batch_size=batch_size
            )
        for obj in objs:
            setattr(obj, FENCE_TOKEN_FIELD, token)
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
    stale in-memory copy must not lower the fence); name it in ``update_fields`` to set it.
    """

    fencing_token = models.BigIntegerField(default=0, editable=False)

    objects = FencedManager()

    #: Per-save state, set by ``save()`` only for the length of the call.
    _leases_fence: int | None = None
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
        if fence is None:
            super().save(*args, **kwargs)
            return
        token = fence_token(fence)
        update_fields = kwargs.get("update_fields")
        if update_fields is not None:
            kwargs["update_fields"] = {*update_fields, FENCE_TOKEN_FIELD}
        previous = self.fencing_token
        self.fencing_token = token
        self._leases_fence = token
        self._leases_force_insert = bool(kwargs.get("force_insert"))
        using = kwargs.get("using") or self._state.db or DEFAULT_DB_ALIAS
        needed_rollback = connections[using].needs_rollback
        try:
            super().save(*args, **kwargs)
        except StaleFencingToken:
            self.fencing_token = previous
            self._keep_transaction_usable(using, needed_rollback)
            raise
        finally:
            del self._leases_fence, self._leases_force_insert

    save.alters_data = True  # type: ignore[attr-defined]

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
        token = self._leases_fence
        if token is None:
            if FENCE_TOKEN_FIELD not in (update_fields or ()):
                values = [v for v in values if v[0].attname != FENCE_TOKEN_FIELD]
            return update(
                base_qs, using, pk_val, values, update_fields, forced_update, *args, **kwargs
            )
        fenced_qs = base_qs.filter(fencing_token__lte=token)
        for _ in range(_UPDATE_ATTEMPTS):
            updated = update(fenced_qs, *rest, **kwargs)
            if updated:
                return updated
            stored = base_qs.filter(pk=pk_val).values_list(FENCE_TOKEN_FIELD, flat=True).first()
            if stored is None:
                return updated  # no such row: Django goes on to the (fenced) insert
            if stored > token:
                break
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
            token = int(self._leases_fence or 0)
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
