"""The guide covers every setting, error and signal the code has (``scripts/test`` builds it)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from django.dispatch import Signal

import idempotency.conf
import idempotency.errors
import leases.conf
import leases.errors
import leases.signals

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide"


def page(name: str) -> str:
    return (GUIDE / name).read_text()


@pytest.mark.parametrize(
    "key", [*leases.conf.DEFAULTS, *(f"IDEMPOTENCY:{k}" for k in idempotency.conf.DEFAULTS)]
)
def test_every_setting_is_documented(key: str) -> None:
    assert f"| `{key.removeprefix('IDEMPOTENCY:')}` |" in page("settings.md")


def _documented_options(engine: str) -> set[str]:
    """The option names in the table under the guide's ``**`engine`**`` heading."""
    section = page("settings.md").split(f"**`{engine}`**", 1)[1].split("\n**`", 1)[0]
    section = section.split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Z_]+)` \|", section, flags=re.MULTILINE))


@pytest.mark.parametrize(
    "engine",
    [
        "leases.backends.database",
        "leases.backends.redis",
        "leases.backends.redlock",
        "leases.backends.zookeeper",
        "leases.backends.etcd",
    ],
)
def test_every_backend_option_is_documented_and_no_other(engine: str) -> None:
    """Unknown options are configuration errors, so a documented one that is gone would
    send readers straight into ``leases.E005``."""
    module = importlib.import_module(engine)
    assert _documented_options(engine) == set(module.Backend.known_options)


@pytest.mark.parametrize("error", [*leases.errors.__all__, *idempotency.errors.__all__])
def test_every_error_is_documented(error: str) -> None:
    assert f"| `{error}` |" in page("errors.md")


SIGNALS = [
    name
    for name in leases.signals.__all__
    if isinstance(getattr(leases.signals, name), Signal)  # the class leases.signals imports
]


@pytest.mark.parametrize("signal", SIGNALS)
def test_every_signal_is_documented_with_its_arguments(signal: str) -> None:
    assert f"| `{signal}` |" in page("operating.md")


def test_every_system_check_is_documented() -> None:
    root = GUIDE.parent.parent
    sources = [*root.glob("leases/**/*.py"), *root.glob("idempotency/**/*.py")]
    ids = set(re.findall(r'id="((?:leases|idempotency)\.[EW]\d+)"', "".join(map(_read, sources))))
    assert ids, "no system check ids found: has the check module moved?"
    missing = sorted(i for i in ids if f"| `{i}` |" not in page("settings.md"))
    assert not missing, f"system checks missing from docs/guide/settings.md: {missing}"


def _read(path: Path) -> str:
    return path.read_text()


def test_every_page_is_in_the_navigation() -> None:
    config = (GUIDE.parent / "mkdocs.yml").read_text()
    for path in GUIDE.rglob("*.md"):
        name = path.relative_to(GUIDE).as_posix()
        assert f": {name}" in config, f"{name} is not in docs/mkdocs.yml's nav"


def _problem_errors() -> list[type[idempotency.errors.IdempotencyError]]:
    """Every error with a problem type of its own: a ``slug`` other than the base class's or
    a ``problem_type`` (client errors the views answer with, and server errors such as
    ``ResponseNotStorable``); only the base and the configuration error have none."""
    base = idempotency.errors.IdempotencyError
    found = [getattr(idempotency.errors, name) for name in idempotency.errors.__all__]
    return [e for e in found if e.slug != base.slug or e.problem_type is not None]


def test_every_error_but_the_base_and_configuration_has_a_problem_type() -> None:
    """So a new error cannot slip past the page test below by inheriting the base's slug."""
    typed = {error.__name__ for error in _problem_errors()}
    without = set(idempotency.errors.__all__) - typed
    assert without == {"IdempotencyError", "IdempotencyImproperlyConfigured"}


@pytest.mark.parametrize("error", _problem_errors(), ids=lambda error: error.__name__)
def test_every_problem_type_is_a_page_of_the_guide(
    error: type[idempotency.errors.IdempotencyError],
) -> None:
    """RFC 9457: a problem's ``type`` should resolve to documentation. Ours are the guide's
    pages (``problems/<slug>.html`` from ``docs/guide/problems/<slug>.md``), which name the
    error; the sections some errors point at instead are checked by test_idempotency_checks."""
    from idempotency.http import problem_type

    uri = problem_type(error.__new__(error))
    assert uri.startswith(idempotency.errors.GUIDE_URL), uri
    path = uri.removeprefix(idempotency.errors.GUIDE_URL).partition("#")[0]
    source = GUIDE / path.replace(".html", ".md")
    assert source.is_file(), f"{uri} has no page {source.relative_to(GUIDE)}"
    if error.problem_type is None:
        assert f"`{error.__name__}`" in source.read_text()
    assert f"`{Path(path).name}`" in page("problems/index.md") or error.problem_type is not None


def _public_names() -> list[tuple[str, str]]:
    import idempotency
    import leases
    import leases.advisory
    import leases.celery

    modules = [leases, leases.advisory, leases.celery, idempotency]
    return [(module.__name__, name) for module in modules for name in module.__all__]


@pytest.mark.parametrize(("module", "name"), _public_names())
def test_every_public_name_is_in_the_api_reference(module: str, name: str) -> None:
    """Each name has a ``::: path`` directive in api.md, at its own definition or through the
    whole module that defines it (the errors), so mkdocstrings renders its docstring."""
    obj = getattr(importlib.import_module(module), name)
    defined_in = getattr(obj, "__module__", module) if callable(obj) else module
    directives = set(re.findall(r"^::: (\S+)$", page("api.md"), flags=re.MULTILINE))
    candidates = {f"{defined_in}.{name}", defined_in, f"{module}.{name}"}
    if not callable(obj):  # a constant: directives name the module that assigns it
        candidates |= {d for d in directives if d.endswith(f".{name}")}
    assert candidates & directives, f"{module}.{name} is missing from docs/guide/api.md"


@pytest.mark.parametrize(
    "name", ["locked_task", "singleton_task", "leader_only", "partitioned", "idempotent_task"]
)
def test_every_celery_decorator_has_a_section(name: str) -> None:
    assert f"## `{name}`" in page("celery.md")


def test_the_changelog_page_is_the_repository_changelog() -> None:
    assert (GUIDE / "changelog.md").resolve() == GUIDE.parent.parent / "CHANGELOG.md"


#: Where the guide is published (``.readthedocs.yaml`` builds ``docs/mkdocs.yml`` there).
GUIDE_URL = "https://django-leases.readthedocs.io/en/stable/"


def _readme_links() -> list[str]:
    """Every link target of the README: inline ``[text](target)``, ``<autolinks>``,
    reference definitions and HTML ``href``/``src``."""
    readme = (GUIDE.parent.parent / "README.md").read_text()
    return [
        *re.findall(r"\]\(\s*<?([^)\s>]+)", readme),
        *re.findall(r"<(https?://[^>\s]+)>", readme),
        *re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", readme, flags=re.MULTILINE),
        *re.findall(r"""(?:href|src)\s*=\s*["']([^"']+)""", readme),
    ]


def test_the_readme_has_no_relative_links() -> None:
    """The README is the package's long description on PyPI, where a link relative to the
    repository (``docs/guide/api.md``, ``LICENSE``) leads nowhere."""
    links = _readme_links()
    assert links, "no links found in README.md"
    relative = [link for link in links if not link.startswith("https://")]
    assert not relative, f"README.md has links PyPI cannot follow: {relative}"


def test_read_the_docs_builds_the_guide_with_its_dependency_group() -> None:
    """The guide's URLs exist only if Read the Docs builds it: from ``docs/mkdocs.yml``, with
    the ``docs`` group of ``pyproject.toml`` (mkdocstrings), failing on a warning as
    ``scripts/test`` does."""
    import tomllib

    import yaml

    root = GUIDE.parent.parent
    config = yaml.safe_load((root / ".readthedocs.yaml").read_text())
    assert config["version"] == 2
    assert config["mkdocs"] == {"configuration": "docs/mkdocs.yml", "fail_on_warning": True}
    assert (root / config["mkdocs"]["configuration"]).is_file()
    groups = tomllib.loads((root / "pyproject.toml").read_text())["dependency-groups"]
    assert any(str(need).startswith("mkdocstrings") for need in groups["docs"])
    assert "python -m pip install --group docs" in config["build"]["jobs"]["post_install"]


def test_the_readme_and_project_urls_point_at_pages_of_the_guide() -> None:
    """Each link into the published guide is a page mkdocs builds (``use_directory_urls:
    false``: ``api.md`` becomes ``api.html``) and an anchor one of its headings makes."""
    import tomllib

    from markdown.extensions.toc import slugify

    project = tomllib.loads((GUIDE.parent.parent / "pyproject.toml").read_text())["project"]
    urls = [*_readme_links(), *project["urls"].values()]
    into_guide = [url for url in urls if url.startswith(GUIDE_URL)]
    assert len(into_guide) >= 10, into_guide
    for url in into_guide:
        path, _, anchor = url.removeprefix(GUIDE_URL).partition("#")
        source = GUIDE / ((path or "index.html").removesuffix(".html") + ".md")
        assert source.is_file(), f"{url}: no page {source.name} in the guide"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", source.read_text(), flags=re.MULTILINE)
            assert anchor in {slugify(heading, "-") for heading in headings}, url


def _python_samples() -> list[tuple[str, str]]:
    """``(page:line, code)`` of every Python sample of the guide and the README."""
    pages = [*sorted(GUIDE.glob("**/*.md")), GUIDE.parent.parent / "README.md"]
    samples = []
    for path in pages:
        if path.name == "changelog.md":
            continue
        text = path.read_text()
        for found in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[: found.start()].count("\n") + 1
            samples.append((f"{path.name}:{line}", found.group(1)))
    return samples


def _exported_names() -> set[str]:
    import idempotency
    import leases
    import leases.celery

    return {*leases.__all__, *idempotency.__all__, *leases.celery.__all__}


@pytest.mark.parametrize(("where", "code"), _python_samples(), ids=lambda v: str(v)[:40])
def test_every_sample_compiles(where: str, code: str) -> None:
    """``ast.parse`` accepts what the compiler refuses (a ``return`` outside a function, a
    ``nonlocal`` at module level, a duplicate argument), so a sample is compiled as written.
    A top-level ``await``/``async with`` is allowed: those samples are fragments of async code,
    as typed into ``python -m asyncio``."""
    compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


@pytest.mark.parametrize(("where", "code"), _python_samples(), ids=lambda v: str(v)[:40])
def test_a_sample_that_imports_imports_what_it_uses(where: str, code: str) -> None:
    """A sample with an import line is copied whole: a name of ours it uses but does not import
    (``step`` used below ``from idempotency import idempotency_key``) fails as written."""
    tree = ast.parse(code)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    if not imports:
        return  # a fragment continuing the page's earlier samples
    bound = {alias.asname or alias.name.split(".")[0] for node in imports for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    missing = sorted((used & _exported_names()) - bound)
    assert not missing, f"{where} uses {missing} without importing them"


#: The modules that need an optional dependency: (module, the library, its extra).
OPTIONAL_MODULES = [
    ("leases.celery", "celery", "celery"),
    ("leases.celery.locked", "celery", "celery"),
    ("idempotency.celery", "celery", "celery"),
    ("leases.metrics", "prometheus_client", "prometheus"),
    ("leases.health", "health_check", "health"),
]
#: Run in a child: ``MISSING`` (and its submodules) cannot be imported, as when not installed.
WITHOUT_LIBRARY = """
import importlib.abc, sys

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == sys.argv[2]:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
try:
    importlib.import_module(sys.argv[1])
except ModuleNotFoundError as exc:
    print(exc.name)
    print(exc)
"""


@pytest.mark.parametrize(("module", "library", "extra"), OPTIONAL_MODULES)
def test_a_module_whose_extra_is_missing_says_which_extra_to_install(
    module: str, library: str, extra: str
) -> None:
    """Without its library, ``import leases.celery`` failed with Python's bare ``No module
    named 'celery'``: it names the extra to install (one ``pyproject.toml`` declares)."""
    import subprocess
    import sys
    import tomllib

    project = tomllib.loads((GUIDE.parent.parent / "pyproject.toml").read_text())["project"]
    assert extra in project["optional-dependencies"]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_LIBRARY, module, library],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    name, message = done.stdout.splitlines()
    assert name.partition(".")[0] == library  # still what ModuleNotFoundError.name says
    top = module.rsplit(".", 1)[0] if module.count(".") > 1 else module
    assert message.startswith(f'{top} needs the "{extra}" extra: ')
    assert f'pip install "django-leases[{extra}]"' in message
