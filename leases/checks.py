"""System checks: misconfiguration is reported by ``manage.py check``, not at first use.

The plain checks ask each backend's *class* about itself (its options, the databases it needs);
nothing here names an engine. Only two checks talk to stores: ``leases.W004`` asks the backends
that can be set up to lose leases by themselves (an evicting Redis) about that, briefly and
silently when they do not answer, and the ``--deploy`` check asks every store everything.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Model
from django.utils.connection import ConnectionDoesNotExist

from . import conf
from .backends import LeaseBackend, backend_class
from .errors import LeaseError

SETTINGS_HINT = "See the settings section of the guide."
#: Seconds plain ``manage.py check`` waits for one store's answer about its own setup.
STORE_CHECK_TIMEOUT = 2.0


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E001: the LEASES setting is invalid."""
    return [Error(message, hint=SETTINGS_HINT, id="leases.E001") for message in conf.problems()]


def _classes() -> tuple[dict[str, type[LeaseBackend]], dict[str, str]]:
    """Each configured alias's backend class, and why the others have none (their ENGINE)."""
    classes: dict[str, type[LeaseBackend]] = {}
    broken: dict[str, str] = {}
    for alias in sorted(conf.get().backends):
        try:
            classes[alias] = backend_class(alias)
        except LeaseError as exc:
            broken[alias] = str(exc)
    return classes, broken


@register(Tags.compatibility)
def check_backends(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E004: a backend's ``ENGINE`` cannot be loaded; leases.E005: its options are wrong
    (unknown or misspelt, a missing cache alias, malformed Redlock nodes...).

    Answered by each backend's class without connecting, so it runs on every ``manage.py``
    command; a backend would refuse the same options when first used.
    """
    if conf.problems():
        return []
    classes, broken = _classes()
    found: list[CheckMessage] = [
        Error(
            message,
            hint='ENGINE is the module path of a lease backend, e.g. "leases.backends.database"; '
            "a backend of an optional extra needs that extra installed.",
            id="leases.E004",
        )
        for message in broken.values()
    ]
    for alias, cls in classes.items():
        options = conf.get().backend(alias).options
        found += [
            Error(problem, hint=SETTINGS_HINT, id="leases.E005")
            for problem in cls.check_options(alias, options)
        ]
    return found


@register(Tags.compatibility, Tags.caches)
def check_backend_limits(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.W005: a backend shares a limit its traffic will outgrow (a cache alias's
    connection pool smaller than the waits one process can have at once).

    Asked of each backend's class without connecting, and only of backends whose options are
    right (leases.E005 says what is wrong with the others). A warning, not an error: a process
    that never has that many acquires at once never meets the limit.
    """
    if conf.problems():
        return []
    found: list[CheckMessage] = []
    for alias, cls in _classes()[0].items():
        options = conf.get().backend(alias).options
        if cls.check_options(alias, options):
            continue
        found += [
            Warning(
                f"lease backend {alias!r}: {problem}",
                hint="Raise the limit the message names, or silence leases.W005 if no "
                "process ever has that many acquires waiting at once.",
                id="leases.W005",
            )
            for problem in cls.check_limits(alias, options)
        ]
    return found


@register(Tags.compatibility, Tags.database)
def check_advisory_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E002: advisory locks or a lease backend need a database that is not PostgreSQL.

    Checked: the ``default`` alias (what ``leases.advisory`` uses unless told otherwise) and
    every alias a configured backend says it uses (:meth:`LeaseBackend.databases`: its lease
    table, or where its tokens come from). Projects that use neither advisory locks nor such a
    backend on a non-PostgreSQL default database silence it with ``SILENCED_SYSTEM_CHECKS``.
    """
    if conf.problems():
        return []
    aliases = {DEFAULT_DB_ALIAS}
    for alias, cls in _classes()[0].items():
        aliases |= cls.databases(conf.get().backend(alias).options)
    errors: list[CheckMessage] = []
    for alias in sorted(aliases):
        try:
            vendor = connections[alias].vendor
        except ConnectionDoesNotExist:
            vendor = "missing"
        if vendor != "postgresql":
            errors.append(
                Error(
                    f"database {alias!r} is {vendor}, but advisory locks and the lease "
                    "backends that use it need PostgreSQL",
                    hint="Point it at PostgreSQL (psycopg 3), or silence leases.E002 if you "
                    "use neither advisory locks nor a lease backend on it and a database router "
                    "keeps the leases and idempotency tables off it (their migrations need "
                    "PostgreSQL: `migrate` refuses any other database).",
                    id="leases.E002",
                )
            )
    return errors


@register(Tags.database, deploy=True)
def check_backend_stores(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E003 / leases.W003: a lease store is unreachable, or can lose leases.

    Only with ``manage.py check --deploy``: it talks to every configured store (a Redis whose
    ``maxmemory-policy`` may evict lease keys, a Redlock with too few nodes), which must never
    happen at import or on every ``manage.py`` command. Backends the plain checks already
    found misconfigured are skipped, and no error of a store's driver escapes: a deploy check
    reports, it never crashes ``check``.
    """
    if conf.problems():
        return []
    from .backends import get_backend

    found: list[CheckMessage] = []
    for alias, cls in _classes()[0].items():
        if cls.check_options(alias, conf.get().backend(alias).options):
            continue  # leases.E005 says why
        try:
            backend = get_backend(alias)
            problems = backend.deploy_checks() + backend.deploy_advice()
        except Exception as exc:  # a driver's error, a cache that is not what it claims...
            detail = str(exc) if isinstance(exc, LeaseError) else f"{type(exc).__name__}: {exc}"
            found.append(Error(_about(alias, detail), id="leases.E003"))
            continue
        found += [Warning(_about(alias, problem), id="leases.W003") for problem in problems]
    return found


def _about(alias: str, detail: str) -> str:
    """``detail`` naming the backend once (a ``BackendUnavailable`` already names it)."""
    named = f"lease backend {alias!r}"
    return detail if detail.startswith(named) else f"{named}: {detail}"


@register(Tags.compatibility)
def check_store_policies(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.W004: a store is set up to lose leases by itself (a Redis ``maxmemory-policy``
    that evicts keys: the key of a held lease vanishes, and a second holder gets in).

    A plain check, not only ``--deploy``: the policy is the store's, invisible in the settings,
    and nothing fails until memory runs short in production. Only backends that override
    :meth:`LeaseBackend.store_checks` are asked, each for at most
    :data:`STORE_CHECK_TIMEOUT` seconds on a thread of its own (a silent network could
    otherwise hang every ``manage.py`` command); a store that does not answer in time, or
    fails, is left to ``leases.E003`` under ``--deploy``.
    """
    if conf.problems():
        return []
    found: list[CheckMessage] = []
    for alias, cls in _classes()[0].items():
        if cls.store_checks is LeaseBackend.store_checks:
            continue
        if cls.check_options(alias, conf.get().backend(alias).options):
            continue  # leases.E005 says why
        found += [
            Warning(
                f"lease backend {alias!r}: {problem}",
                hint="Set the store's policy so it never evicts lease keys (on Redis "
                "maxmemory-policy noeviction, or a server of their own); until then "
                "expect LeaseLost, and rely on fencing for safety.",
                id="leases.W004",
            )
            for problem in _store_problems(alias)
        ]
    return found


def _store_problems(alias: str) -> list[str]:
    """``store_checks()`` of ``alias``'s backend, or nothing if it fails or takes too long."""
    from .backends import get_backend

    answer: list[str] = []

    def ask() -> None:
        # Unreachable or broken: leases.E003 (the deploy check) reports it.
        with contextlib.suppress(Exception):
            answer.extend(get_backend(alias).store_checks())

    asking = threading.Thread(target=ask, name=f"leases-check-{alias}", daemon=True)
    asking.start()
    asking.join(STORE_CHECK_TIMEOUT)
    return [] if asking.is_alive() else answer


@register(Tags.compatibility)
def check_default_ttl(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.W001: ``DEFAULT_TTL`` leaves no time to retry a renewal before the lease ends."""
    if conf.problems():
        return []
    settings = conf.get()
    window = settings.retry_window(settings.default_ttl)
    if window >= conf.MIN_RETRY_WINDOW:
        return []
    return [
        Warning(
            f'LEASES["DEFAULT_TTL"] = {settings.default_ttl:g}s leaves {window:.3f}s to retry a '
            "failed renewal before the lease's validity ends",
            hint="Raise DEFAULT_TTL or lower RENEW_FRACTION; see 'Sizing the TTL' in the guide.",
            id="leases.W001",
        )
    ]


@register(Tags.models)
def check_fenced_managers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.W006: a fenced model whose default manager is not a ``FencedManager``."""
    from django.apps import apps

    configs = app_configs if app_configs is not None else apps.get_app_configs()
    return fenced_manager_problems(model for config in configs for model in config.get_models())


def fenced_manager_problems(models: Iterable[type[Model]]) -> list[CheckMessage]:
    """Each concrete ``FencedModel`` whose default manager gives plain querysets: under
    ``class Order(Base, FencedModel)`` the first base's ``objects`` wins, and ``objects``
    then has no ``fenced()``, lets ``update(fencing_token=0)`` lower the fence, and ignores
    ``require_fence``, silently."""
    from .fencing import FencedModel
    from .fencing.queryset import FencedQuerySet

    found: list[CheckMessage] = []
    for model in models:
        if not issubclass(model, FencedModel) or model._meta.abstract or model._meta.proxy:
            continue
        manager = model._default_manager
        if isinstance(manager.get_queryset(), FencedQuerySet):
            continue
        found.append(
            Warning(
                f"{model._meta.label}'s default manager {manager.name!r} "
                f"({type(manager).__name__}) is not a FencedManager: its update(), "
                "bulk_update() and delete() are unfenced, may lower fencing_token and ignore "
                "require_fence, and it has no fenced()",
                hint="Declare objects = FencedManager() on the model (or derive your "
                "manager from FencedManager / FencedQuerySet), or list FencedModel before "
                "the base whose manager wins.",
                obj=model,
                id="leases.W006",
            )
        )
    return found


@register(Tags.models)
def check_fence_cascades(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.W007: a ``require_fence`` model whose rows another model's deletion writes."""
    from django.apps import apps

    configs = app_configs if app_configs is not None else apps.get_app_configs()
    return fence_cascade_problems(model for config in configs for model in config.get_models())


def fence_cascade_problems(models: Iterable[type[Model]]) -> list[CheckMessage]:
    """Each foreign key of a ``require_fence`` model whose ``on_delete`` writes its rows
    (``CASCADE``, ``SET_NULL``, ``SET_DEFAULT``, ``SET(...)``, a database-level cascade).

    Deleting the referenced row deletes or rewrites them through Django's collector, which
    goes past the fenced manager, unfenced and unseen, so ``require_fence``'s promise (no
    unfenced write to a stored row) does not hold for them. ``PROTECT``, ``RESTRICT`` and
    ``DO_NOTHING`` write nothing. A multi-table child's link to a parent that requires the
    fence too is fine: deleting the parent is itself fenced."""
    from django.db.models import DO_NOTHING, PROTECT, RESTRICT

    harmless = (PROTECT, RESTRICT, DO_NOTHING)
    found: list[CheckMessage] = []
    for model in models:
        if not getattr(model, "require_fence", False) or model._meta.abstract:
            continue
        for field in model._meta.local_concrete_fields:  # a parent's are its own to report
            remote = field.remote_field
            if remote is None or not (field.many_to_one or field.one_to_one):
                continue
            on_delete = getattr(remote, "on_delete", None)
            if on_delete is None or on_delete in harmless:
                continue
            target = remote.model
            if getattr(remote, "parent_link", False) and getattr(target, "require_fence", False):
                continue
            label = target._meta.label if isinstance(target, type) else str(target)
            if getattr(remote, "parent_link", False):
                message = (
                    f"{model._meta.label} sets require_fence but its multi-table parent "
                    f"{label} does not: writing through {label} (its update(), save(), "
                    f"delete()) writes {model._meta.label} rows unfenced"
                )
            else:
                message = (
                    f"{model._meta.label}.{field.name} has on_delete="
                    f"{getattr(on_delete, '__name__', repr(on_delete))}: deleting a {label} "
                    f"deletes or rewrites {model._meta.label} rows unfenced, although the "
                    "model sets require_fence"
                )
            found.append(
                Warning(
                    message,
                    hint="Set require_fence on the parent too; for a foreign key, use "
                    "on_delete=models.PROTECT (or RESTRICT) and delete the fenced rows first "
                    "with Model.objects.fenced(lease).delete(); or silence this check if such "
                    "writes need no fence.",
                    obj=model,
                    id="leases.W007",
                )
            )
    return found
