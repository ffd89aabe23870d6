"""Moved to :mod:`devservers` (the demo and benchmarks use it too, and must not import tests).

Kept so that branches written against the old path still import; new code imports
``devservers``.
"""

from devservers import *  # noqa: F403
from devservers import __all__  # noqa: F401
