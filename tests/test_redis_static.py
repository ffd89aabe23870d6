"""Static proof that no Redis command path deletes or expires a lease key without comparing.

Every Lua constant of the Redis backends is scanned: a command that deletes, overwrites or
re-times a key must sit inside an ``if redis.call('GET', <that key>) == ARGV[n]`` block (or
``== owned``, the value built by hashing the secret presented, or one
comparing the value's token prefix, ``string.sub(... or '', 1, #ARGV[n]) == ARGV[n]``), or be a
``SET ... NX`` (which cannot overwrite). The only exceptions are the wake-up list (a key the
script ``RPUSH``es to) and the name's counter (a key it reads ``'epoch'`` from), which hold no
grant: a counter Redis forgets costs a new epoch from the database. The Python sources are
scanned too: the only direct write is Redlock's ``SET NX``, a script is run only by its own text
or SHA1 (a ``Script`` made from a scanned constant: a Redis Cluster client runs them so), and
nothing lists keys by pattern (``KEYS``).

The shared-lease scripts (:mod:`leases.backends._redis_shared`) check their grant differently: a
readers' group is a lock value *ending* in a mark plus an entry in a hash, checked once at the top
by a pinned piece of Lua that returns early when the grant is not theirs. They are held to that:
no destructive command before the check.
"""

from __future__ import annotations

import ast
import inspect
import re
from types import ModuleType
from typing import cast

import pytest

from leases.backends import _redis_async as redis_async
from leases.backends import _redis_conn as redis_conn
from leases.backends import _redis_io as redis_io
from leases.backends import _redis_kept as redis_kept
from leases.backends import _redis_nodes as redis_nodes
from leases.backends import _redis_protocol as redis_protocol
from leases.backends import _redis_scripts as redis_scripts
from leases.backends import _redis_shared as redis_shared
from leases.backends import _redlock_async as redlock_async
from leases.backends import redis as redis_backend
from leases.backends import redlock as redlock_backend

MODULES = [
    redis_backend,
    redlock_backend,
    redis_async,
    redis_conn,
    redis_io,
    redis_kept,
    redis_nodes,
    redis_protocol,
    redis_scripts,
    redis_shared,
    redlock_async,
]
#: The shared-lease scripts and the line of each that ends its check of the grant.
SHARED_CHECKS = {
    "SHARED_ACQUIRE_LUA": "return {BUSY, current or '', known_run}",
    "SHARED_RENEW_LUA": "return no",
    "SHARED_RELEASE_LUA": "return no",
    "STOP_READERS_LUA": "if current and string.sub(current, -#ARGV[1]) == ARGV[1] then",
}
DESTRUCTIVE = {
    "DEL", "UNLINK", "EXPIRE", "PEXPIRE", "EXPIREAT", "PEXPIREAT", "PERSIST", "SET", "SETEX",
    "PSETEX", "GETDEL", "GETEX", "GETSET", "RENAME", "RENAMENX", "MOVE", "RESTORE", "FLUSHDB",
    "FLUSHALL", "HDEL",
}  # fmt: skip
CALL = re.compile(r"redis\.call\(\s*'(\w+)'\s*(?:,\s*(KEYS\[\d+\]))?([^)]*)\)")
GUARD = re.compile(
    r"redis\.call\(\s*'GET'\s*,\s*(KEYS\[\d+\])\s*\)\s*==\s*(?:ARGV\[\d+\]|owned\b)"
    r"|string\.sub\(redis\.call\(\s*'GET'\s*,\s*(KEYS\[\d+\])\s*\)\s*or\s*''\s*,\s*1\s*,"
    r"\s*#ARGV\[(\d+)\]\s*\)\s*==\s*ARGV\[\3\]"
)
PY_FORBIDDEN = {
    "delete", "unlink", "expire", "pexpire", "expireat", "pexpireat", "persist", "getdel",
    "getex", "getset", "setex", "psetex", "rename", "execute_command", "eval", "evalsha",
    "flushdb", "flushall", "keys",
}  # fmt: skip


def scripts() -> list[tuple[str, str]]:
    return [
        (f"{module.__name__}.{name}", value)
        for module in MODULES
        for name, value in vars(module).items()
        if name.endswith("_LUA") and isinstance(value, str) and name not in SHARED_CHECKS
    ]


def written_before_check(script: str, check: str) -> list[str]:
    """Destructive commands of a shared-lease script that come before its check's last line."""
    lines = [line.strip() for line in script.splitlines()]
    if check not in lines:
        return [f"no check {check!r}"]
    before = lines[: lines.index(check)]
    return [
        line for line in before for cmd, _, _ in CALL.findall(line) if cmd.upper() in DESTRUCTIVE
    ]


@pytest.mark.parametrize(("name", "check"), SHARED_CHECKS.items())
def test_shared_scripts_write_only_after_checking_the_grant(name: str, check: str) -> None:
    script = getattr(redis_shared, name)
    assert written_before_check(script, check) == []
    if check == "return no":  # renew and release: the pinned reader check, called first
        assert redis_shared.READER_CHECK_LUA in script
        assert "local no = refused(" in script.split(check)[0].splitlines()[-3]
    if name == "SHARED_ACQUIRE_LUA":  # busy unless free or a group, and no writer waiting
        assert "if (current and not group) or redis.call('EXISTS', KEYS[4]) == 1 then" in script
        assert "string.sub(value, -#mark) == mark" in script


def test_the_shared_scan_catches_a_write_before_the_check() -> None:
    script = "redis.call('DEL', KEYS[1])\nlocal no = refused(ARGV[5])\nif no then\nreturn no\nend"
    assert written_before_check(script, "return no")
    assert written_before_check("redis.call('DEL', KEYS[1])", "return no")


#: ``owned`` may stand for ``ARGV[n]`` only as the value built from the secret presented.
OWNED = re.compile(r"local owned = ARGV\[\d+\] \.\. redis\.sha1hex\(ARGV\[\d+\]\) \.\. ")


def _stop_signs(calls: list[tuple[str, str, str]]) -> set[str]:
    """Keys a script only ever sets to ``'1'`` with an expiry: a waiting writer's stop sign for
    new readers, which holds no grant (a script that reads one as a grant is not let off)."""
    stamped = {key for cmd, key, rest in calls if cmd == "SET" and _SIGN.match(rest)}
    return {
        key
        for key in stamped
        if all(k != key or (cmd == "SET" and _SIGN.match(rest)) for cmd, k, rest in calls)
    }


_SIGN = re.compile(r"\s*,\s*'1'\s*,\s*'PX'\s*,\s*\w+(?:\[\d+\])?\s*$")


def unguarded(script: str) -> list[str]:
    """Destructive commands in ``script`` not protected by a compare on the same key."""
    if "== owned" in script and not OWNED.search(script):
        return ["compares with `owned` without building it from the presented secret"]
    calls = CALL.findall(script)
    wake_lists = {key for cmd, key, _ in calls if cmd.upper() == "RPUSH"}
    counters = {key for cmd, key, rest in calls if cmd == "HMGET" and "'epoch'" in rest}
    signs = _stop_signs(calls)
    guards: list[str | None] = []  # the key each open block compared, or None
    problems = []
    for line in script.splitlines():
        stripped = line.strip()
        if stripped.startswith(("if ", "for ", "while ")) or stripped.endswith(" do"):
            guard = GUARD.search(stripped)
            guards.append((guard.group(1) or guard.group(2)) if guard else None)
        for cmd, key, rest in CALL.findall(stripped):
            cmd = cmd.upper()
            if cmd in ("KEYS", "SCAN"):
                problems.append(f"{cmd} lists keys by pattern: {stripped}")
            if cmd not in DESTRUCTIVE or key in wake_lists | counters | signs:
                continue
            if cmd == "SET" and "'NX'" in rest.upper():
                continue
            if key not in guards:
                problems.append(f"{cmd} {key} without comparing its holder+token: {stripped}")
        if stripped == "end" and guards:
            guards.pop()
    return problems


@pytest.mark.parametrize(("name", "script"), scripts(), ids=[n for n, _ in scripts()])
def test_no_lua_script_deletes_or_expires_without_comparing(name: str, script: str) -> None:
    assert unguarded(script) == []


def test_the_scripts_that_must_exist_are_scanned() -> None:
    names = {name.rsplit(".", 1)[1] for name, _ in scripts()}
    assert {"ACQUIRE_LUA", "RENEW_LUA", "RELEASE_LUA", "FORCE_RELEASE_LUA"} <= names


def test_the_scan_catches_bare_deletes_and_expires() -> None:
    assert unguarded("redis.call('DEL', KEYS[1])")
    assert unguarded("redis.call('PEXPIRE', KEYS[1], ARGV[2])")
    assert unguarded("redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])")
    sign = "redis.call('SET', KEYS[3], '1', 'PX', ARGV[7])"
    assert not unguarded(sign)  # a stop sign: it holds no grant and expires
    assert unguarded(sign + "\nredis.call('GET', KEYS[3])")  # read as something else too
    assert unguarded("redis.call('SET', KEYS[3], '1')")  # never expires
    assert unguarded(
        "if redis.call('GET', KEYS[2]) == ARGV[1] then\n  redis.call('DEL', KEYS[1])\nend"
    )
    assert unguarded("if x then\nend\nredis.call('DEL', KEYS[1])")
    assert unguarded("redis.call('KEYS', 'leases:*')")
    counter = "redis.call('HMGET', KEYS[2], 'epoch')\nredis.call('PEXPIRE', KEYS[2], 5)"
    assert not unguarded(counter)
    assert unguarded(counter.replace("KEYS[2], 5", "KEYS[1], 5"))  # the counter's key only
    assert not unguarded(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then\n  redis.call('DEL', KEYS[1])\nend"
    )
    owned = "local owned = ARGV[1] .. redis.sha1hex(ARGV[3]) .. ':' .. ARGV[2]\n"
    guarded = "if redis.call('GET', KEYS[1]) == owned then\n  redis.call('DEL', KEYS[1])\nend"
    assert not unguarded(owned + guarded)
    assert unguarded(guarded)  # `owned` must come from the secret presented
    prefix = "if string.sub(redis.call('GET', KEYS[1]) or '', 1, #ARGV[4]) == ARGV[{}] then"
    assert not unguarded(f"{prefix.format(4)}\n  redis.call('DEL', KEYS[1])\nend")
    assert unguarded(f"{prefix.format(3)}\n  redis.call('DEL', KEYS[1])\nend")


#: A script is run by its own text or SHA1 (``Script.text``, ``Script.sha``): the scripts are
#: made from the Lua constants scanned above, so running one is no uncompared write.
SCRIPT_RUNS = {"eval": "text", "evalsha": "sha"}


def _runs_a_script_constant(attr: str, args: list[ast.expr]) -> bool:
    """Whether ``.attr(*args)`` runs a :class:`~leases.backends._redis_conn.Script` (its
    ``.text`` through ``eval``, its ``.sha`` through ``evalsha``), not Lua written inline."""
    first = args[0] if args else None
    return (
        attr in SCRIPT_RUNS and isinstance(first, ast.Attribute) and first.attr == SCRIPT_RUNS[attr]
    )


def python_writes(source: str) -> list[str]:
    """Direct redis-py calls in ``source`` that could delete, expire or overwrite a key.

    Both shapes are caught: methods (``client.delete(...)``, ``client.set(...)`` without
    ``nx=True``) and raw commands spelled as arguments or tuples (``("DEL", key)``,
    ``fan_out("SET", key, value)`` without ``"NX"``).
    """
    found = []
    tree = ast.parse(source)
    context_vars = {  # ``ContextVar.set`` is no Redis command
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign | ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "ContextVar"
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        raw: list[ast.expr] = []
        if isinstance(node, ast.Call):
            raw = node.args
            if isinstance(node.func, ast.Attribute):
                attr = node.func.attr
                keywords = {k.arg: k.value for k in node.keywords}
                nx = (
                    isinstance(keywords.get("nx"), ast.Constant)
                    and cast(ast.Constant, keywords["nx"]).value is True
                )
                on_var = (
                    isinstance(node.func.value, ast.Name) and node.func.value.id in context_vars
                )
                forbidden = attr in PY_FORBIDDEN or (attr == "set" and not nx and not on_var)
                if forbidden and not _runs_a_script_constant(attr, node.args):
                    found.append(f"line {node.lineno}: .{attr}(...)")
        elif isinstance(node, ast.Tuple):
            raw = node.elts
        words = [str(a.value).upper() for a in raw if isinstance(a, ast.Constant)]
        first = words[0] if raw and isinstance(raw[0], ast.Constant) and words else ""
        nx_set = first == "SET" and "NX" in words[1:]
        if first in DESTRUCTIVE | {"KEYS"} and not nx_set:
            found.append(f"line {cast(ast.expr, node).lineno}: raw {first}")  # a call or tuple
    return found


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__ for m in MODULES])
def test_no_python_command_path_writes_without_comparing(module: ModuleType) -> None:
    assert python_writes(inspect.getsource(module)) == []


def test_the_python_scan_catches_bare_commands() -> None:
    source = "def f(c):\n    c.delete('k')\n    c.set('k', 'v', px=5)\n    c.keys('x*')\n"
    assert len(python_writes(source)) == 3
    assert python_writes("def f(c):\n    c.set('k', 'v', nx=True, px=5)\n") == []
    assert python_writes("c = ('DEL', 'k')\n") and python_writes("f('PEXPIRE', 'k', 5)\n")
    assert python_writes("f('SET', 'k', 'v', 'PX', 5)\n")
    assert python_writes("v: ContextVar[str] = ContextVar('v')\nv.set('k')\n") == []
    assert python_writes("v = ContextVar('v')\nc.set('k', 'v')\n")
    assert python_writes("f('SET', 'k', 'v', 'NX', 'PX', 5)\n") == []
    # Lua written inline is not a scanned constant; a Script's text or SHA1 is.
    assert python_writes("c.eval(\"return redis.call('DEL', KEYS[1])\", 1, 'k')\n")
    assert python_writes("c.evalsha(sha, 1, 'k')\n") and python_writes("c.eval(s.sha, 1)\n")
    assert python_writes("c.evalsha(s.sha, 1, 'k')\nc.eval(s.text, 1, 'k')\n") == []
