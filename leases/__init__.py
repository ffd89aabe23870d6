"""django-leases: advisory locks, leases with fencing tokens, leader election.

``import leases`` must not touch Django's app registry (it runs while ``INSTALLED_APPS`` load),
so everything that needs models is re-exported lazily through a module ``__getattr__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .errors import (
    BackendNotSupported,
    BackendUnavailable,
    BlockingInEventLoop,
    DatabaseNotSupported,
    FenceRequired,
    FencingTokenRevoked,
    FencingUnavailable,
    InvalidFencingToken,
    InvalidLeaseName,
    InvalidLeaseOption,
    LeaseAlreadyHeld,
    LeaseCheckFailed,
    LeaseCheckUnavailable,
    LeaseDeadlock,
    LeaseError,
    LeaseLost,
    LeaseNotHeld,
    LeasesImproperlyConfigured,
    LeaseUnavailable,
    NotInTransaction,
    RevocationIncomplete,
    StaleFencingToken,
)

# ``lease`` names both a submodule and its function. Imported eagerly (it touches no models) so
# the function wins: a later ``import leases.lease`` would otherwise rebind ``leases.lease`` to
# the module and break ``from leases import lease``.
from .lease import Lease, acquire, lease
from .semaphore import Slot, acquire_slot, semaphore  # eager for the same reason as ``lease``

if TYPE_CHECKING:  # each feature module adds its line when it lands
    from .aio import aacquire, alease
    from .aio_semaphore import aacquire_slot, asemaphore
    from .election import Leadership, aelect, elect, leader_of
    from .fencing import FencedModel, check_fence

__all__ = [
    "BackendNotSupported",
    "BackendUnavailable",
    "BlockingInEventLoop",
    "DatabaseNotSupported",
    "FenceRequired",
    "FencedModel",
    "FencingTokenRevoked",
    "FencingUnavailable",
    "InvalidFencingToken",
    "InvalidLeaseName",
    "InvalidLeaseOption",
    "Leadership",
    "Lease",
    "LeaseAlreadyHeld",
    "LeaseCheckFailed",
    "LeaseCheckUnavailable",
    "LeaseDeadlock",
    "LeaseError",
    "LeaseLost",
    "LeaseNotHeld",
    "LeaseUnavailable",
    "LeasesImproperlyConfigured",
    "NotInTransaction",
    "RevocationIncomplete",
    "Slot",
    "StaleFencingToken",
    "aacquire",
    "aacquire_slot",
    "acquire",
    "acquire_slot",
    "aelect",
    "alease",
    "asemaphore",
    "check_fence",
    "elect",
    "leader_of",
    "lease",
    "semaphore",
]

_LAZY = {
    "aacquire": "aio",
    "alease": "aio",
    "aacquire_slot": "aio_semaphore",
    "asemaphore": "aio_semaphore",
    "Lease": "lease",
    "acquire": "lease",
    "lease": "lease",
    "FencedModel": "fencing",
    "check_fence": "fencing",
    "elect": "election",
    "aelect": "election",
    "leader_of": "election",
    "Leadership": "election",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
