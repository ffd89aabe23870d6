"""A paginator for admin changelists over tables of millions of rows.

Django's paginator counts the rows of the list it pages (``SELECT COUNT(*)``) on every page
view: over ten million keys that is a scan of the whole table, longer than the page itself by
orders of magnitude. :class:`EstimatedCountPaginator` asks the planner first (``EXPLAIN``:
statistics, no rows read); a list the planner expects to be small is still counted exactly,
a large one shows the estimate. An operator paging through a million rows needs the order
of magnitude, not the last digit.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.paginator import Paginator
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
    uses its estimate, so no page view scans a large table to count it."""

    exact_below = EXACT_COUNT_BELOW

    @cached_property
    def count(self) -> int:
        objects = self.object_list
        if isinstance(objects, QuerySet):
            estimate = planner_estimate(objects)
            if estimate is not None and estimate >= self.exact_below:
                return estimate
        return int(super().count)
