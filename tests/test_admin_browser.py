"""The admin pages in a real browser: headless Chromium against the live server.

``scripts/test`` installs ``chromium`` and ``chromium-driver`` from the distribution when they
are missing (as root with apt); this test skips only when no Chromium can be had at all.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission

from leases.backends import get_backend
from leases.models import ForceRelease
from tests.factories import StaffUserFactory, UserFactory
from tests.locks_fixture import LockScene, lock_scene_fixture  # noqa: F401 - fixture

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]


def _find(*names: str) -> str | None:
    return next((found for name in names if (found := shutil.which(name))), None)


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium = _find("chromium", "chromium-browser", "google-chrome")
    driver_path = _find("chromedriver", "chromium-driver")
    if chromium is None or driver_path is None:
        pytest.skip(
            "no Chromium and chromedriver on PATH: install the distribution's chromium and "
            "chromium-driver packages (scripts/test does so as root with apt-get)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    ARTIFACTS.mkdir(exist_ok=True)
    profile = tempfile.mkdtemp(prefix="leases-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    driver.implicitly_wait(10)  # element lookups wait for the page a click started loading
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


#: What ChromeDriver answers now and then, instead of a stale element reference, when asked
#: about an element of a page the browser is leaving (SeleniumHQ/selenium issue 15401; seen
#: here with Chromium 156 in one fresh-clone run).
DETACHED = "Node with given id does not belong to the document"


def gone(element: Any) -> Callable[[Any], bool]:
    """Selenium's ``staleness_of(element)``, reading ChromeDriver's detached-node error as
    stale too: both mean the element's page has been replaced."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    def predicate(_browser: Any) -> bool:
        try:
            element.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            if DETACHED in (exc.msg or ""):
                return True
            raise
        return False

    return predicate


def submit_login(browser: Any, username: str) -> None:
    """Fill in the admin login form, submit it, and wait until the next page has loaded.

    ``click()`` may return before the navigation it starts has finished; reading the page
    then would still see the login form.
    """
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys("password")
    button = browser.find_element(By.CSS_SELECTOR, "input[type=submit]")
    button.click()
    WebDriverWait(browser, 30).until(gone(button))


class _LeavingPage:
    """A browser whose login button, once clicked, answers as ChromeDriver sometimes does for
    an element of the page being navigated away from (see :data:`DETACHED`)."""

    def __init__(self) -> None:
        self.clicked = False

    def find_element(self, by: str, value: str) -> Any:
        return self

    def send_keys(self, text: str) -> None:
        pass

    def click(self) -> None:
        self.clicked = True

    def is_enabled(self) -> bool:
        from selenium.common.exceptions import WebDriverException

        if self.clicked:
            raise WebDriverException(
                "unknown error: unhandled inspector error: "
                '{"code":-32000,"message":"Node with given id does not belong to the document"}'
            )
        return True


def test_the_login_wait_reads_a_node_detached_by_the_navigation_as_the_page_gone() -> None:
    """A fresh-clone run failed here: ``staleness_of`` lets only a stale element reference
    through, and ChromeDriver answered the old login button with the detached-node error."""
    pytest.importorskip("selenium")
    browser = _LeavingPage()
    submit_login(browser, "someone")
    assert browser.clicked


def test_staff_sees_held_and_waiting_locks_and_force_releases(
    browser: Any, live_server: Any, lock_scene: LockScene
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    operator: Any = StaffUserFactory(username="browser-operator")
    codenames = ["view_lease", "force_release_lease"]
    operator.user_permissions.add(*Permission.objects.filter(codename__in=codenames))

    browser.get(f"{live_server.url}/admin/login/?next=/admin/leases/advisorylock/")
    submit_login(browser, "browser-operator")

    waiting = browser.find_element(By.CSS_SELECTOR, "#advisory-locks tr.waiting")
    assert lock_scene.advisory in waiting.text and "lock-waiter" in waiting.text
    held = browser.find_element(By.CSS_SELECTOR, "#advisory-locks tr.held")
    assert lock_scene.advisory in held.text and str(lock_scene.holder_pid) in held.text
    browser.save_screenshot(str(ARTIFACTS / "admin-advisory-locks.png"))

    browser.find_element(By.LINK_TEXT, "Leases (database backend)").click()
    row = browser.find_element(By.XPATH, f"//tr[.//th[normalize-space()='{lock_scene.held}']]")
    assert "worker-1" in row.text and "4242" in row.text and "billing" in row.text
    browser.save_screenshot(str(ARTIFACTS / "admin-leases.png"))
    row.find_element(By.NAME, "_selected_action").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("force_release")
    browser.find_element(By.NAME, "index").click()

    target = browser.find_element(By.CSS_SELECTOR, "#release-targets tr.release-target")
    assert lock_scene.held in target.text and "worker-1" in target.text
    browser.save_screenshot(str(ARTIFACTS / "admin-force-release-confirm.png"))
    assert get_backend().inspect(lock_scene.held).held  # type: ignore[union-attr]  # not yet
    browser.find_element(By.CSS_SELECTOR, "input[value='Yes, force-release']").click()

    message = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li.success").text
    assert f"Released {lock_scene.held!r}" in message
    browser.save_screenshot(str(ARTIFACTS / "admin-force-release.png"))
    info = get_backend().inspect(lock_scene.held)
    assert info is not None and not info.held
    assert ForceRelease.objects.get(name=lock_scene.held).by == operator


def test_non_staff_and_staff_without_permission_are_refused(
    browser: Any, live_server: Any, lock_scene: LockScene
) -> None:
    from selenium.webdriver.common.by import By

    def log_in(username: str) -> None:
        browser.delete_all_cookies()
        browser.get(f"{live_server.url}/admin/login/?next=/admin/leases/lease/")
        submit_login(browser, username)

    UserFactory(username="browser-customer")
    log_in("browser-customer")
    assert "/admin/login/" in browser.current_url  # the admin refuses non-staff logins
    assert "correct username and password for a staff account" in browser.page_source
    assert lock_scene.held not in browser.page_source

    viewer: Any = StaffUserFactory(username="browser-viewer")
    viewer.user_permissions.add(Permission.objects.get(codename="view_lease"))
    log_in("browser-viewer")
    assert lock_scene.held in browser.page_source  # may look ...
    options = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "option")]
    assert "force_release" not in options  # ... but not take a lease away
    browser.get(f"{live_server.url}/admin/leases/advisorylock/{lock_scene.holder_pid}/terminate/")
    assert "403" in browser.title or "Forbidden" in browser.page_source
    browser.save_screenshot(str(ARTIFACTS / "admin-refused.png"))
