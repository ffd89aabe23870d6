"""A guarded save's ``INSERT``, refused in the statement that writes.

A fenced save with a revocable offer, or a lease-checked save, must not insert once the grant
is revoked or the lease is no longer held; checked beforehand, a revocation could slip in
between. So the save's one-row ``INSERT INTO t (cols) VALUES (...)`` is rewritten, through
Django's ``execute_wrapper``, into ``INSERT INTO t (cols) SELECT ... WHERE <conditions>``, while
Django still builds the statement and reads back what it returns.

Only the saved model's own tables (its table and, under multi-table inheritance, its
parents') are rewritten: a receiver's or an overridden ``save()``'s inserts on the same
connection are someone else's statements. A value Django writes as ``DEFAULT`` (a field's
``db_default``, an automatic key) is not allowed in a ``SELECT`` list: its column is left out,
which the server fills with the same default.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from django.db import connections, models

from .. import revocation
from ..revocation import NOT_REVOKED_SQL, Offer
from .checked import LEASE_HELD_SQL, LeaseCheck
from .tokens import revoked, row_resource

__all__ = ["InsertUnless", "insert_select"]

#: A query parameter in Django's SQL (``%%`` is an escaped percent sign, not a parameter).
_PLACEHOLDER = re.compile(r"%%|%s")
#: A value Django leaves to the column's default.
_DEFAULT = "DEFAULT"


class InsertUnless:
    """The ``execute_wrapper`` of a guarded save: the grant is not revoked (a fenced save),
    the lease is still held (a lease-checked save), or both.

    So an insert (auto primary key, the fenced upsert, a multi-table parent's row) refuses in
    the very statement that writes. A refused insert writes nothing; the wrapper then raises
    :class:`~leases.errors.LeaseCheckFailed` or :class:`~leases.errors.FencingTokenRevoked`
    (an empty upsert for neither reason is a stale token, which the upsert itself reports).

    ``instance`` is the row being saved, any model's: it is read for its tables and for the
    name a refusal gives it (:func:`~.tokens.row_resource`), nothing of
    :class:`~.model.FencedModel`, whose ``save()`` makes this wrapper.
    """

    def __init__(
        self, instance: models.Model, using: str, offer: Offer | None, check: LeaseCheck | None
    ) -> None:
        self.instance = instance
        self.using = using
        self.offer = offer
        self.check = check
        qn = connections[using].ops.quote_name
        meta = instance._meta
        models = [meta.concrete_model or type(instance), *meta.get_parent_list()]
        self.tables = tuple(f"INSERT INTO {qn(m._meta.db_table)} " for m in models)

    def __call__(
        self, execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]
    ) -> Any:
        if many or not sql.startswith(self.tables):
            return execute(sql, params, many, context)
        conditions: list[str] = []
        extra: list[Any] = []
        if self.offer is not None:
            conditions.append(NOT_REVOKED_SQL)
            extra += self.offer.params()
        if self.check is not None:
            conditions.append(LEASE_HELD_SQL)
            extra += self.check.params()
        rewritten = insert_select(sql, " AND ".join(conditions))
        if rewritten is None:
            return execute(sql, params, many, context)
        sql, placeholders = rewritten
        params = [*params[:placeholders], *extra, *params[placeholders:]]
        result = execute(sql, params, many, context)
        if context["cursor"].rowcount == 0:
            self._refused()
        return result

    def _refused(self) -> None:
        resource = row_resource(self.instance)
        if self.check is not None and not self.check.holds(self.using):
            raise self.check.refused(resource)
        if self.offer is not None:
            through = revocation.revoked_through(self.offer, self.using)
            if through is not None:
                raise revoked(type(self.instance), resource, self.offer, through)


def insert_select(sql: str, condition: str) -> tuple[str, int] | None:
    """``(the INSERT as INSERT ... SELECT ... WHERE condition, parameters before the
    condition)`` for a one-row ``INSERT INTO t (cols) VALUES (...)``; ``None`` for any other
    statement. Columns whose value is ``DEFAULT`` are left out (see the module docstring)."""
    head, found, rest = sql.partition(" VALUES (")
    if not found or not head.startswith("INSERT INTO "):
        return None
    end = closing_parenthesis(rest)
    if end is None:
        return None
    values, tail = rest[:end], rest[end + 1 :]
    if tail.lstrip().startswith(","):  # several rows: not a save's insert
        return None
    target, opened, columns = head.partition(" (")
    if not opened or not columns.endswith(")"):
        return None
    names, items = split_top_level(columns[:-1]), split_top_level(values)
    if len(names) != len(items):
        return None
    kept = [(n, v) for n, v in zip(names, items, strict=True) if v.strip() != _DEFAULT]
    listed = f" ({', '.join(n.strip() for n, _ in kept)})" if kept else ""
    selected = ", ".join(v.strip() for _, v in kept)
    placeholders = sum(1 for found in _PLACEHOLDER.findall(selected) if found == "%s")
    select = f"SELECT {selected}" if kept else "SELECT"
    return f"{target}{listed} {select} WHERE {condition}{tail}", placeholders


def split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses, quotes and quoted names."""
    parts, start = [], 0
    for index, char, depth in _scanned(text):
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def closing_parenthesis(text: str) -> int | None:
    """Index of the ``)`` that closes a ``(`` just before ``text`` starts (quotes skipped)."""
    for index, char, depth in _scanned(text, depth=1):
        if char == ")" and depth == 0:
            return index
    return None


def _scanned(text: str, depth: int = 0) -> Iterator[tuple[int, str, int]]:
    """Each character of ``text`` outside quotes and quoted names, with the parenthesis depth
    after it (a ``)`` that closes the outermost one comes at depth 0)."""
    quote = ""
    for index, char in enumerate(text):
        if quote:
            if char == quote:
                quote = ""
            continue
        if char in "'\"":
            quote = char
            continue
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        yield index, char, depth
