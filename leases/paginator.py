"""A paginator for admin changelists over tables of millions of rows.

Django's paginator counts the rows of the list it pages (``SELECT COUNT(*)``) on every page
view: over ten million keys that is a scan of the whole table, longer than the page itself by
orders of magnitude. :class:`EstimatedCountPaginator` asks the planner first (``EXPLAIN``:
statistics, no rows read); a list the planner expects to be small is still counted exactly,
a large one shows the estimate. An operator paging through a million rows needs the order
of magnitude, not the last digit.

An estimate can be low (statistics not yet analyzed after a bulk load, a search the planner
misjudges): the pages would end at it and the rows past it be out of reach. So the page at or
past the estimated last one is read with one row more than it shows: a row more means a page
more (offered as "next"), fewer than a page means the list ends there (the count is then
exact). Each page past the estimate costs what any page costs, never a count.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.paginator import EmptyPage, Page, Paginator
from django.db.models import QuerySet
from django.utils.functional import cached_property

__all__ = ["EXACT_COUNT_BELOW", "EstimatedCountPaginator", "planner_estimate"]

#: Lists the planner expects to have fewer rows than this are counted exactly (cheap).
EXACT_COUNT_BELOW = 10_000


def planner_estimate(queryset: QuerySet[Any]) -> int | None:
    """The planner's row estimate for ``queryset`` (no rows read); ``None`` if it has none."""
    try:
        plan = json.loads(queryset.explain(format="json"))
        return int(plan[0]["Plan"]["Plan Rows"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Counts exactly when the planner expects under :data:`EXACT_COUNT_BELOW` rows, else
    uses its estimate, so no page view scans a large table to count it; pages from the
    estimated last one on find out where the list really ends (see the module)."""

    exact_below = EXACT_COUNT_BELOW
    #: The count is the planner's estimate (set by :attr:`count`), not a count.
    estimated = False

    @cached_property
    def count(self) -> int:
        objects = self.object_list
        if isinstance(objects, QuerySet):
            estimate = planner_estimate(objects)
            if estimate is not None and estimate >= self.exact_below:
                self.estimated = True
                return estimate
        return int(super().count)

    def validate_number(self, number: Any) -> int:
        """Django's check, but a page past an estimated count is not refused: it may hold
        rows the planner did not expect (:meth:`page` finds out)."""
        try:
            return int(super().validate_number(number))
        except EmptyPage:
            if self.estimated and int(number) > 1:
                return int(number)  # past the estimated pages, not below the first
            raise

    def page(self, number: Any) -> Page[Any]:
        number = self.validate_number(number)
        if not self.estimated or number < self.num_pages:
            return super().page(number)
        bottom = (number - 1) * self.per_page
        rows = list(self.object_list[bottom : bottom + self.per_page + 1])
        if not rows and number > 1:
            raise EmptyPage("That page contains no results")
        if len(rows) > self.per_page:  # more past this page: offer the next one
            self._recount(max(self.count, bottom + len(rows)))
        else:  # the list ends here: the count is known now
            self._recount(bottom + len(rows))
            self.estimated = False
        return Page(rows[: self.per_page], number, self)

    def _recount(self, count: int) -> None:
        """Replace the count (a cached property), and the page count derived from it."""
        self.__dict__["count"] = count
        self.__dict__.pop("num_pages", None)
