"""The Celery decorators' plumbing, in process: key templates, lease injection, task classes.

What happens between workers and a broker is proven in ``tests/test_celery.py``; these check
the pieces every task relies on without starting one.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from idempotency.celery import IdempotentTask, idempotent_task
from idempotency.errors import IdempotencyImproperlyConfigured
from idempotency.models import IdempotencyKey
from leases import acquire
from leases.celery import (
    LeaderOnlyTask,
    LockedTask,
    PartitionedTask,
    SingletonTask,
    format_key,
    leader_only,
    locked_task,
    partition_for,
    partitioned,
    singleton_task,
)
from leases.celery._base import Call, current_call
from leases.errors import InvalidLeaseName, InvalidLeaseOption, LeaseUnavailable
from tests.celery_app import app


def test_key_is_the_same_for_positional_keyword_and_default_arguments() -> None:
    @locked_task(key="sync:{account}:{region}", app=app, name="keys.sync")
    def sync(account: int, region: str = "eu") -> None: ...

    assert format_key("sync:{account}:{region}", sync, 7) == "sync:7:eu"
    assert format_key("sync:{account}:{region}", sync, account=7, region="eu") == "sync:7:eu"
    assert sync.lease_name((7, "us"), {}) == "sync:7:us"


def test_key_of_a_bound_task_skips_self_and_the_injected_lease() -> None:
    @locked_task(key="bound:{account}", bind=True, app=app, name="keys.bound")
    def bound(self: Any, account: int, lease: Any) -> None: ...

    assert bound.lease_name((3,), {}) == "bound:3"


@pytest.mark.parametrize(
    "decorator",
    [
        lambda key: locked_task(key=key, app=app, name="keys.typo.locked"),
        lambda key: singleton_task(key=key, app=app, name="keys.typo.singleton"),
        lambda key: partitioned(key=key, partitions=4, app=app, name="keys.typo.partitioned"),
        lambda key: idempotent_task(key=key, app=app, name="keys.typo.idempotent"),
    ],
    ids=["locked", "singleton", "partitioned", "idempotent"],
)
@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("x:{acount}", r"\{acount\} is not a parameter of .*typo \(its parameters: account\)"),
        ("x:{acount.id}", r"\{acount\} is not a parameter"),
        ("x:{0}", r"\{0\} is positional"),
        ("x:{}", r"\{\} is positional"),
        ("x:{account", "not a str.format template"),
    ],
)
def test_a_key_naming_no_parameter_is_refused_when_the_task_is_defined(
    decorator: Callable[[str], Callable[[Callable[..., None]], object]], template: str, says: str
) -> None:
    """Found only when the task ran, a misspelt field failed every call in a worker."""
    with pytest.raises(InvalidLeaseOption, match=says):

        @decorator(template)
        def typo(account: int) -> None: ...


def test_a_key_template_of_a_bound_task_may_name_its_parameters_not_self() -> None:
    @locked_task(key="b:{account.pk}:{region[0]}", bind=True, app=app, name="keys.bound.ok")
    def ok(self: Any, account: Any, region: str) -> None: ...

    with pytest.raises(InvalidLeaseOption, match=r"\{self\} is not a parameter"):

        @locked_task(key="b:{self}", bind=True, app=app, name="keys.bound.self")
        def bad(self: Any, account: int) -> None: ...


def test_a_locked_tasks_key_cannot_name_the_injected_lease() -> None:
    with pytest.raises(InvalidLeaseOption, match=r"\{lease\} is not a parameter"):

        @locked_task(key="x:{lease}", app=app, name="keys.lease")
        def injected(account: int, lease: Any) -> None: ...


def test_a_template_met_only_at_run_time_still_fails_with_its_name() -> None:
    """A template a task class computes (``lease_name`` overridden) is checked when used."""

    @locked_task(key="ok:{account}", app=app, name="keys.runtime")
    def task(account: int) -> None: ...

    with pytest.raises(TypeError, match="acount"):
        format_key("x:{acount}", task, 1)


def test_a_callable_key_gets_the_task_arguments() -> None:
    @locked_task(key=lambda a, b: f"sum:{a + b}", app=app, name="keys.callable")
    def add(a: int, b: int) -> None: ...

    assert add.lease_name((2, 3), {}) == "sum:5"


def test_the_lease_parameter_is_filled_wherever_it_sits_and_hidden_from_callers() -> None:
    @locked_task(key="inj:{a}", app=app, name="keys.inject")
    def middle(a: int, lease: Any, b: int = 2, *, c: int = 3) -> tuple[Any, ...]:
        return a, lease, b, c

    marker = object()
    reset = current_call.set(Call(middle, marker))  # type: ignore[arg-type]
    try:
        assert middle.run(1, 5, c=6) == (1, marker, 5, 6)
        assert middle.run(a=1) == (1, marker, 2, 3)
    finally:
        current_call.reset(reset)
    with pytest.raises(TypeError):  # Celery's argument check at send time knows no ``lease``
        middle.__header__(1, None, 2)  # type: ignore[attr-defined]


def test_bare_decorator_and_option_checks() -> None:
    @locked_task
    def bare() -> None: ...

    assert isinstance(bare, LockedTask) and bare.lease_name((), {}) == bare.name
    with pytest.raises(ValueError, match="on_busy"):
        locked_task(on_busy="wait")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="partitions"):
        partitioned(key="{a}", partitions=0)


@pytest.mark.parametrize(
    ("decorator", "options"),
    [
        # Accepted when decorating; every run then failed in the worker (or every delay()).
        (locked_task, {"ttl": -1}),
        (locked_task, {"ttl": "60"}),
        (locked_task, {"timeout": -1}),
        (singleton_task, {"ttl": 0}),
        (leader_only, {"ttl": float("nan")}),
        # Refused, but with a bare ValueError that no LeaseError handler catches.
        (locked_task, {"on_busy": "retyr"}),
        (singleton_task, {"on_duplicate": "ignore"}),
        # Accepted; the first lease lost mid-run then failed to report its own loss.
        (locked_task, {"on_lost": "log"}),
    ],
)
def test_bad_options_are_refused_when_decorating(decorator: Any, options: dict[str, Any]) -> None:
    with pytest.raises(InvalidLeaseOption, match=next(iter(options))):
        decorator(**options)


@pytest.mark.parametrize(
    ("decorator", "options", "error"),
    [
        (locked_task, {"key": 123, "name": "keys.int_key.locked"}, InvalidLeaseOption),
        (singleton_task, {"key": 123, "name": "keys.int_key.singleton"}, InvalidLeaseOption),
        (idempotent_task, {"key": 123, "name": "keys.int_key.idempotent"}, InvalidLeaseOption),
        (leader_only, {"key": 123}, InvalidLeaseName),
        (leader_only, {"key": "x" * 300}, InvalidLeaseName),
    ],
    ids=["locked", "singleton", "idempotent", "leader-int", "leader-too-long"],
)
def test_a_key_or_election_that_is_no_name_is_refused_when_decorating(
    decorator: Any, options: dict[str, Any], error: type[Exception]
) -> None:
    """Only templates were checked: a key that was neither a template nor a callable, or an
    election name no store takes, was accepted, and every call then failed in the worker."""

    def body(n: int) -> None: ...

    with pytest.raises(error):
        decorator(app=app, **options)(body)


def test_an_idempotent_tasks_fingerprint_is_the_same_for_every_form_of_one_call() -> None:
    """The key is built from the arguments bound to the signature; the fingerprint was built
    from the raw ``args`` and ``kwargs``, so ``charge(7, cents=100)`` after ``charge(7, 100)``
    (or a default passed explicitly) was refused as another request under the same key."""

    @idempotent_task(key="charge:{order}", app=app, name="keys.fingerprint")
    def charge(order: int, cents: int = 0, *, note: str = "") -> None: ...

    one = charge.fingerprint((7, 100), {})
    assert charge.fingerprint((), {"order": 7, "cents": 100}) == one
    assert charge.fingerprint((7,), {"cents": 100}) == one
    assert charge.fingerprint((7, 100), {"note": ""}) == one
    assert charge.fingerprint((7,), {}) == charge.fingerprint((7, 0), {})
    assert charge.fingerprint((7, 101), {}) != one
    assert charge.fingerprint((7, 100), {"note": "x"}) != one
    # The form a call sends positionally, every parameter given, keeps its earlier fingerprint
    # (keys stored before the fix still match their redeliveries).
    raw = json.dumps(["keys.fingerprint", [7, 100], {"note": ""}], sort_keys=True)
    assert charge.fingerprint((7, 100), {"note": ""}) == hashlib.sha256(raw.encode()).hexdigest()


@pytest.mark.parametrize(
    "options",
    [
        {"ttl": -5},
        {"lock": "30"},
        {"wait": -1},
        {"on_in_flight": "skip"},  # behaved as "retry"
        {"atomic": "no"},
        {"claim_in_transaction": 1},
    ],
)
def test_an_idempotent_tasks_bad_options_are_refused_when_decorating(
    options: dict[str, Any],
) -> None:
    """Accepted when decorating: every run then failed in the worker, or ran otherwise."""
    with pytest.raises(IdempotencyImproperlyConfigured, match=next(iter(options))):
        idempotent_task(**options)


def test_bases_combine_lease_outside_idempotency() -> None:
    @locked_task(key="both:{n}", base=IdempotentTask, app=app, name="keys.both")
    def both(n: int) -> int:
        return n

    assert isinstance(both, LockedTask) and isinstance(both, IdempotentTask)
    order = both.__class__.__mro__  # the task, not the proxy of an app not yet finalized
    assert order.index(LockedTask) < order.index(IdempotentTask)

    @idempotent_task(app=app, name="keys.plain_idem")
    def plain(n: int) -> int:
        return n

    assert isinstance(plain, IdempotentTask) and not isinstance(plain, LockedTask)


def test_an_idempotent_task_with_a_lease_holds_one_lease_per_key_around_its_claim() -> None:
    """``idempotent_task(base=LockedTask)`` named its lease after the task: every key of the
    task waited behind one lease, and the lease was taken inside the claim."""

    @idempotent_task(key="charge:{order}", base=LockedTask, app=app, name="keys.charge")
    def charge(order: int, lease: Any) -> None: ...

    assert isinstance(charge, LockedTask) and isinstance(charge, IdempotentTask)
    order = charge.__class__.__mro__  # the task, not the proxy of an app not yet finalized
    assert order.index(LockedTask) < order.index(IdempotentTask)  # the lease around the claim
    assert charge.lease_name((7,), {}) == "celery:keys.charge:charge:7"
    assert charge.lease_name((8,), {}) == "celery:keys.charge:charge:8"

    @idempotent_task(key="c:{order}", base=LockedTask, lease_key="all-charges", app=app,
                     name="keys.charge_one_lease")  # fmt: skip
    def named(order: int) -> None: ...

    assert isinstance(named, LockedTask)
    assert named.lease_name((7,), {}) == "all-charges"

    @idempotent_task(key=lambda text: text, base=LockedTask, app=app, name="keys.long_key")
    def long_key(text: str) -> None: ...

    assert isinstance(long_key, LockedTask)
    key = "k" * 255
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert long_key.lease_name((key,), {}) == f"celery:keys.long_key:sha256:{digest}"

    @idempotent_task(base=LockedTask, app=app, name="keys.task_id_key")
    def by_task_id() -> None: ...

    assert isinstance(by_task_id, LockedTask)
    assert by_task_id.lease_name((), {}) == "keys.task_id_key"  # called directly: no task id
    by_task_id.push_request(id="the-task-id")
    try:
        assert by_task_id.lease_name((), {}) == "celery:keys.task_id_key:the-task-id"
    finally:
        by_task_id.pop_request()


@pytest.mark.django_db(transaction=True)
def test_an_idempotent_task_with_a_lease_computes_its_key_once_a_run() -> None:
    """``idempotent_task(base=LockedTask)`` called the key callable twice a run: once to name
    the lease, once more to claim the key. A callable that reads the database paid for it
    twice, and one that is not pure (a clock, a counter) named the lease after one key and
    claimed another, so the lease did not cover the claim it was there for."""
    calls: list[int] = []

    def key(order: int) -> str:
        calls.append(order)
        return f"once:{order}:{len(calls)}"  # impure on purpose: a second call differs

    @idempotent_task(key=key, base=LockedTask, bind=True, app=app, name="keys.key_once")
    def charge(self: Any, order: int) -> str:
        held = self.lease
        assert held is not None
        return str(held.name)

    leased = charge.apply((7,), task_id="key-once-1").get()
    assert calls == [7]
    claimed = IdempotencyKey.objects.get(scope="celery:keys.key_once")
    assert leased == f"celery:keys.key_once:{claimed.key}"  # the lease is the claim's key's
    charge.apply((8,), task_id="key-once-2").get()
    assert calls == [7, 8]


class _RegionLockedTask(LockedTask):
    def lease_name(self, args: tuple[Any, ...], kwargs: Any) -> str:
        return f"region:{args[1]}"


def test_a_locked_base_of_ones_own_keeps_its_lease_name_hook() -> None:
    @idempotent_task(key="{order}", base=_RegionLockedTask, app=app, name="keys.own_base")
    def own(order: int, region: str) -> None: ...

    assert isinstance(own, _RegionLockedTask) and isinstance(own, IdempotentTask)
    assert own.lease_name((7, "eu"), {}) == "region:eu"


@pytest.mark.parametrize(
    ("decorator", "typo", "suggestion"),
    [
        (locked_task, "bussy_max_retries", "busy_max_retries"),
        (locked_task, "acks_lat", "acks_late"),
        (idempotent_task, "tll", "ttl"),
        (idempotent_task, "in_flight_max_retry", "in_flight_max_retries"),
        (singleton_task, "on_duplicat", "on_duplicate"),
        (leader_only, "backnd", "backend"),
        (lambda **o: partitioned(partitions=2, **o), "queue_prefx", "queue_prefix"),
    ],
    ids=["locked", "celery", "idempotent", "idempotent-attr", "singleton", "leader", "part"],
)
def test_an_option_nothing_reads_is_refused_when_decorating(
    decorator: Any, typo: str, suggestion: str
) -> None:
    """Celery made every unknown option a task attribute: a typo ran the task on defaults."""
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{typo}'.*'{suggestion}'"):
        decorator(**{typo: 3}, app=app)


def test_celery_options_and_attributes_of_the_bases_pass() -> None:
    @locked_task(
        key="opts:{n}",
        app=app,
        name="keys.opts",
        expires=60,
        store_eager_result=True,  # set from the settings when bound, unless given
        autoretry_for=(ConnectionError,),
        retry_backoff=True,
        retry_jitter=False,
        max_retries=2,
        acks_late=True,
        busy_max_retries=5,
        idempotency_lock=30,  # an attribute of the base mixed in
        base=IdempotentTask,
    )
    def opts(n: int) -> None: ...

    assert isinstance(opts, IdempotentTask)
    assert opts.busy_max_retries == 5 and opts.idempotency_lock == 30 and opts.expires == 60


def test_an_attribute_the_decorator_sets_is_refused_as_an_option() -> None:
    with pytest.raises(TypeError, match=r"sets the task attribute 'lease_ttl'.*ttl"):
        locked_task(lease_ttl=5, app=app)
    with pytest.raises(TypeError, match=r"must be a celery\.Task subclass"):
        locked_task(base=object, app=app)


def test_a_task_is_refused_where_a_function_is_expected() -> None:
    """Stacked, the outer task's body called the inner task directly: outside any worker's
    request, a busy lease raised instead of retrying, and the outer decorator named nothing."""

    @locked_task(key="stack:{n}", app=app, name="keys.stack_inner")
    def inner(n: int) -> None: ...

    with pytest.raises(TypeError, match=r"decorates a function, not a task.*base="):
        idempotent_task(app=app, name="keys.stack_outer")(inner)
    with pytest.raises(TypeError, match="decorates a function, not a task"):
        locked_task(inner)


def test_leader_only_names_its_election_with_key_and_leaves_name_to_celery() -> None:
    """``leader_only(name=...)`` named the election, so Celery's own ``name=`` could not be
    given, and one who meant it got an election of that name and a task named otherwise."""

    @leader_only(key="nightly", name="keys.nightly_task", app=app)
    def nightly() -> None: ...

    assert nightly.name == "keys.nightly_task" and nightly.election() == "nightly"

    @leader_only(app=app)
    def default() -> None: ...

    assert default.election() == default.name  # the election of the task's own name

    # Alone, name= may be an election (as it was) or a task name (as elsewhere): refused.
    with pytest.raises(TypeError, match=r"leader_only\(name=...\) is ambiguous.*key="):
        leader_only(name="nightly")
    with pytest.raises(InvalidLeaseOption, match="not a template"):
        leader_only(key="nightly:{region}")


def test_partitions_are_stable_documented_and_spread() -> None:
    # the documented function: BLAKE2b-64 of the key, unsigned, modulo the partition count
    import hashlib

    digest = hashlib.blake2b(b"customer-42", digest_size=8).digest()
    assert partition_for("customer-42", 7) == int.from_bytes(digest, "big") % 7
    spread = Counter(partition_for(f"k{n}", 4) for n in range(400))
    assert set(spread) == {0, 1, 2, 3} and min(spread.values()) > 60

    @partitioned(key="{customer}", partitions=4, app=app, name="keys.part")
    def part(customer: str) -> None: ...

    assert isinstance(part, PartitionedTask)
    assert (
        part.partition_queue(("customer-42",), {}) == f"keys.part.{partition_for('customer-42', 4)}"
    )


def test_only_locked_tasks_take_a_lease_parameter() -> None:
    @idempotent_task(key="{lease}", app=app, name="keys.not_a_lease")
    def named_lease(lease: str) -> str:
        return lease

    assert named_lease.run("kept") == "kept"  # an ordinary argument, not injected

    @idempotent_task(base=LockedTask, key="x", app=app, name="keys.idem_locked")
    def inside(lease: Any) -> Any:
        return lease

    assert "lease" not in inspect.signature(inside.run).parameters


FLAKY_RUNS: Counter[str] = Counter()


@idempotent_task(
    app=app,
    bind=True,
    autoretry_for=(ConnectionError,),
    max_retries=3,
    name="keys.flaky",
    in_flight_backoff=0.0,
)
def flaky(self: Any) -> None:
    FLAKY_RUNS[self.request.id] += 1
    raise ConnectionError("provider down")


@pytest.mark.django_db(transaction=True)
def test_an_in_flight_retry_leaves_the_tasks_own_retry_budget_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``retry(max_retries=in_flight_max_retries)`` left that budget (100) on the task object,
    shared by every later run in the process: Celery's autoretry then used it for the task's
    own failures, and a body with ``max_retries=3`` ran 101 times instead of 4."""
    from idempotency.http import digest
    from idempotency.store import begin

    fingerprint = digest([flaky.fingerprint((), {}).encode()])
    begin(f"celery:{flaky.name}", "held-elsewhere", fingerprint, ttl=60, lock_timeout=60)
    real = IdempotentTask.in_flight

    def in_flight(self: Any, key: str, exc: Any) -> Any:
        IdempotencyKey.objects.filter(key="held-elsewhere").delete()  # the other copy gives up
        return real(self, key, exc)

    monkeypatch.setattr(IdempotentTask, "in_flight", in_flight)
    flaky.apply(task_id="held-elsewhere")
    monkeypatch.undo()
    assert "override_max_retries" not in vars(flaky)
    flaky.apply(task_id="a-later-call")
    assert FLAKY_RUNS["a-later-call"] == 4  # max_retries=3: the first run and three retries


LOCKED_FLAKY_RUNS: Counter[str] = Counter()


@locked_task(
    key="keys-flaky:{n}",
    app=app,
    bind=True,
    autoretry_for=(ConnectionError,),
    max_retries=3,
    busy_backoff=0.0,
    busy_backoff_max=0.0,
    busy_max_retries=6,
    name="keys.locked_flaky",
)
def locked_flaky(self: Any, n: int) -> None:
    LOCKED_FLAKY_RUNS[self.request.id] += 1
    raise ConnectionError("provider down")


@pytest.mark.django_db(transaction=True)
def test_a_busy_retry_leaves_a_locked_tasks_own_retry_budget_alone() -> None:
    """``lease_busy`` left ``retry(max_retries=busy_max_retries)`` on the task object, as
    ``in_flight`` once did: autoretry then gave the body's own failures that budget, and a
    body with ``max_retries=3`` ran ``busy_max_retries + 1`` times instead of 4."""
    holder = acquire("keys-flaky:1", ttl=30)
    try:
        busy = locked_flaky.apply((1,), task_id="busy-call")
        assert isinstance(busy.result, LeaseUnavailable), busy.result
    finally:
        holder.release()
    assert "override_max_retries" not in vars(locked_flaky)
    locked_flaky.apply((1,), task_id="a-later-call")
    assert LOCKED_FLAKY_RUNS["a-later-call"] == 4  # max_retries=3: the first run and three retries


NAN = float("nan")


@pytest.mark.parametrize(
    ("base", "attribute", "value", "error"),
    [
        (LockedTask, "lease_key", 123, InvalidLeaseOption),
        (LockedTask, "lease_ttl", -5, InvalidLeaseOption),
        (LockedTask, "lease_ttl", "60", InvalidLeaseOption),
        (LockedTask, "lease_backend", None, InvalidLeaseOption),
        (LockedTask, "lease_timeout", -1, InvalidLeaseOption),
        (LockedTask, "lease_timeout", NAN, InvalidLeaseOption),
        (LockedTask, "lease_limit", 0, InvalidLeaseOption),
        (LockedTask, "lease_limit", True, InvalidLeaseOption),
        (LockedTask, "on_busy", "retyr", InvalidLeaseOption),
        (LockedTask, "busy_backoff", -0.5, InvalidLeaseOption),
        (LockedTask, "busy_backoff", NAN, InvalidLeaseOption),
        (LockedTask, "busy_backoff_max", float("inf"), InvalidLeaseOption),
        (LockedTask, "busy_max_retries", "3", InvalidLeaseOption),
        (LockedTask, "busy_max_retries", -1, InvalidLeaseOption),
        (LockedTask, "on_lease_lost", "log", InvalidLeaseOption),
        (LockedTask, "inject_lease", "no", InvalidLeaseOption),
        (SingletonTask, "singleton_key", 1, InvalidLeaseOption),
        (SingletonTask, "singleton_ttl", 0, InvalidLeaseOption),
        (SingletonTask, "singleton_backend", 1, InvalidLeaseOption),
        (SingletonTask, "on_duplicate", "ignore", InvalidLeaseOption),
        (LeaderOnlyTask, "leader_name", "x" * 300, InvalidLeaseName),
        (LeaderOnlyTask, "leader_name", "nightly:{region}", InvalidLeaseOption),
        (LeaderOnlyTask, "leader_ttl", NAN, InvalidLeaseOption),
        (LeaderOnlyTask, "leader_backend", b"default", InvalidLeaseOption),
        (PartitionedTask, "partition_key", 5, InvalidLeaseOption),
        (PartitionedTask, "partitions", 0, InvalidLeaseOption),
        (PartitionedTask, "partitions", "4", InvalidLeaseOption),
        (PartitionedTask, "partition_queue_prefix", 5, InvalidLeaseOption),
        (IdempotentTask, "idempotency_key", 123, InvalidLeaseOption),
        (IdempotentTask, "idempotency_ttl", -5, IdempotencyImproperlyConfigured),
        (IdempotentTask, "idempotency_lock", "30", IdempotencyImproperlyConfigured),
        (IdempotentTask, "idempotency_wait", -1, IdempotencyImproperlyConfigured),
        (IdempotentTask, "idempotency_wait", None, IdempotencyImproperlyConfigured),
        (IdempotentTask, "on_in_flight", "later", IdempotencyImproperlyConfigured),
        (IdempotentTask, "in_flight_backoff", NAN, IdempotencyImproperlyConfigured),
        (IdempotentTask, "in_flight_max_retries", 2.5, IdempotencyImproperlyConfigured),
        (IdempotentTask, "idempotency_atomic", "no", IdempotencyImproperlyConfigured),
        (IdempotentTask, "idempotency_claim_in_transaction", 1, IdempotencyImproperlyConfigured),
    ],
)
def test_a_subclass_setting_an_option_that_cannot_work_is_refused_when_defined(
    base: type[Any], attribute: str, value: object, error: type[Exception]
) -> None:
    """The base classes are the documented API, but only the decorators checked their options:
    ``class Sync(LockedTask): lease_ttl = -5`` was accepted, and every run failed (or ran on a
    retry budget of ``"3"``) in the worker, long after the deploy."""
    with pytest.raises(error, match=rf"BadTask\.{attribute}\b"):
        type("BadTask", (base,), {attribute: value})


@pytest.mark.parametrize(
    ("bases", "attribute", "value", "error"),
    [
        ((LockedTask, IdempotentTask), "on_in_flight", "later", IdempotencyImproperlyConfigured),
        ((LockedTask, IdempotentTask), "on_busy", "wait", InvalidLeaseOption),
        ((IdempotentTask, LockedTask), "busy_max_retries", "3", InvalidLeaseOption),
        ((SingletonTask, LockedTask), "lease_limit", 0, InvalidLeaseOption),
        (
            (_RegionLockedTask, IdempotentTask),
            "idempotency_wait",
            -1,
            IdempotencyImproperlyConfigured,
        ),
    ],
)
def test_a_class_mixing_bases_is_checked_against_each(
    bases: tuple[type[Any], ...], attribute: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=rf"BadTask\.{attribute}\b"):
        type("BadTask", bases, {attribute: value})


def test_subclasses_setting_options_that_work_are_accepted() -> None:
    class Locked(LockedTask):
        lease_key = "sync:{account}"
        lease_ttl = 60
        lease_backend = "default"
        lease_timeout = 2.5
        lease_limit = 3
        on_busy = "skip"
        busy_backoff = 0
        busy_backoff_max = 2.5
        busy_max_retries = 0
        on_lease_lost = print
        inject_lease = False

    class Idempotent(IdempotentTask):
        idempotency_key = staticmethod(lambda order: f"order:{order}")
        idempotency_ttl = 3600
        idempotency_lock = 30.5
        idempotency_wait = 0
        on_in_flight = "raise"
        in_flight_backoff = 0.0
        in_flight_max_retries = 3
        idempotency_atomic = False
        idempotency_claim_in_transaction = True

    class Singleton(SingletonTask):
        singleton_key = "{n}"
        singleton_ttl = 600
        on_duplicate = "raise"

    class Leader(LeaderOnlyTask):
        leader_name = "nightly"
        leader_ttl = 30

    class Partitioned(PartitionedTask):
        partition_key = "{customer}"
        partitions = 8
        partition_queue_prefix = "orders"

    class Mixed(Locked, Idempotent): ...

    assert Mixed.lease_limit == 3 and Mixed.in_flight_max_retries == 3
    for base in (LockedTask, IdempotentTask, SingletonTask, LeaderOnlyTask, PartitionedTask):
        type("Defaults", (base,), {})  # None means "the setting", read only when a task runs
    # A value computed when the task runs has none to check when the class is made.
    type("Computed", (LockedTask,), {"lease_ttl": property(lambda task: 60)})


def test_a_task_made_with_app_task_is_checked_with_its_options() -> None:
    class Busy(LockedTask):
        on_busy = "skip"

    def body(n: int) -> None: ...

    made = app.task(base=Busy, lease_ttl=30, name="keys.attrs.ok", shared=False, lazy=False)(body)
    assert isinstance(made, Busy) and made.lease_ttl == 30 and made.on_busy == "skip"
    with pytest.raises(InvalidLeaseOption, match=r"body\.lease_ttl\b"):
        app.task(base=Busy, lease_ttl=-5, name="keys.attrs.bad", shared=False, lazy=False)(body)
    with pytest.raises(IdempotencyImproperlyConfigured, match=r"body\.on_in_flight\b"):
        app.task(base=IdempotentTask, on_in_flight="later", name="keys.attrs.bad_idem",
                 shared=False, lazy=False)(body)  # fmt: skip


@pytest.mark.parametrize(
    ("decorator", "options", "error", "says"),
    [
        # Celery options that set a base's attribute, passed on unchecked to the worker.
        (locked_task, {"busy_max_retries": "3"}, InvalidLeaseOption, "busy_max_retries"),
        (locked_task, {"busy_backoff": NAN}, InvalidLeaseOption, "busy_backoff"),
        (
            idempotent_task,
            {"in_flight_backoff": -1},
            IdempotencyImproperlyConfigured,
            "in_flight_backoff",
        ),
        # ... or an attribute of a base mixed in.
        (idempotent_task, {"base": LockedTask, "lease_ttl": -5}, InvalidLeaseOption, "lease_ttl"),
        (idempotent_task, {"base": LockedTask, "on_busy": "wait"}, InvalidLeaseOption, "on_busy"),
        (
            locked_task,
            {"base": IdempotentTask, "idempotency_lock": 0},
            IdempotencyImproperlyConfigured,
            "idempotency_lock",
        ),
        # The decorator's own parameters, named as the caller wrote them.
        (leader_only, {"key": "x:{y}"}, InvalidLeaseOption, r"invalid key="),
        (locked_task, {"limit": 0}, InvalidLeaseOption, r"invalid limit="),
        (locked_task, {"on_lost": "log"}, InvalidLeaseOption, r"invalid on_lost="),
    ],
)
def test_a_decorator_checks_the_attributes_it_sets_before_any_app_makes_the_task(
    decorator: Any, options: dict[str, Any], error: type[Exception], says: str
) -> None:
    """Without ``app=``, the task class is made when an app is finalized (a worker's start):
    the decorator checks what it passes on when it is applied, with the classes' own checks."""
    with pytest.raises(error, match=says):
        decorator(**options)


def test_a_key_template_set_on_a_task_class_is_checked_against_its_run() -> None:
    """The decorators check a key template's fields against the task's parameters when the
    task is defined; a template set on a class (``app.task(base=LockedTask, lease_key=...)``,
    or a class body with its own ``run``) was checked for its type only, and a misspelt field
    failed every run in the worker."""

    def sync(account: int) -> None: ...

    def bound_sync(self: Any, account: int) -> None: ...

    with pytest.raises(InvalidLeaseOption, match="acount"):
        typo = app.task(base=LockedTask, lease_key="sync:{acount}", name="keys.class_typo")(sync)
        assert typo.name  # made on first use: the app may not be finalized yet

    with pytest.raises(InvalidLeaseOption, match="acount"):

        class Sync(LockedTask):
            lease_key = "sync:{acount}"

            def run(self, account: int) -> None: ...

    with pytest.raises(InvalidLeaseOption, match="ordr"):

        class Charge(IdempotentTask):
            idempotency_key = "charge:{ordr}"

            def run(self, order: int) -> None: ...

    class Fine(LockedTask):
        lease_key = "sync:{account}"

        def run(self, account: int) -> None: ...

    bound = app.task(base=LockedTask, lease_key="sync:{account}", bind=True, name="keys.fine")(
        bound_sync
    )
    assert bound.lease_name((7,), {}) == "sync:7"


def _account_key(account: int) -> str:
    return f"acct:{account}"


def test_a_key_function_set_on_a_task_class_gets_the_tasks_arguments() -> None:
    """A key function stored on a class binds as a method: set through ``app.task(base=
    LockedTask, lease_key=fn)`` (Celery puts the options in the class it makes) or in a class
    body, it was called with the task as its first argument, and every run failed or was
    locked under the wrong name. The decorators wrapped theirs; a class keeps it plain now."""

    def sync(account: int) -> None: ...

    made = app.task(base=LockedTask, lease_key=_account_key, name="keys.fn_key")(sync)
    assert made.lease_name((7,), {}) == "acct:7"

    class Sync(LockedTask):
        lease_key = _account_key

        def run(self, account: int) -> None: ...

    assert Sync().lease_name((8,), {}) == "acct:8"

    class Charge(IdempotentTask):
        idempotency_key = _account_key

        def run(self, account: int) -> None: ...

    charge: Any = Charge()
    key = charge.idempotency_key  # as idempotency_key_for reads it, from the task
    assert callable(key) and key(9) == "acct:9"
