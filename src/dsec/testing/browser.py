"""A headless Chromium driven by Selenium, for the dashboard's tests and its benchmark
(tests/test_ui.py, benchmarks/ui_first_paint.py): Debian's chromium and chromium-driver
(scripts/install-extras.sh ui), never a downloaded browser or driver."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
WIDTH, HEIGHT = 1366, 768
INSTALL = "install chromium, chromium-driver and selenium: scripts/install-extras.sh ui"


def missing() -> str | None:
    """Why no browser can be started here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return f"python selenium is not installed ({INSTALL})"
    for exe, pkg in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(exe) is None:
            return f"no {exe} on PATH: Debian's {pkg} is not installed ({INSTALL})"
    return None


def start(width: int = WIDTH, height: int = HEIGHT) -> Any:
    """A headless Chromium at width x height (the viewport of a 1366x768 laptop screen)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="dsec-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--disable-background-networking",
                f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))
    except BaseException:
        shutil.rmtree(profile, ignore_errors=True)
        raise
    driver.dsec_profile = profile
    driver.set_page_load_timeout(60)
    return driver


def stop(driver: Any) -> None:
    """Quit the browser and remove its profile directory."""
    try:
        driver.quit()
    finally:
        profile = getattr(driver, "dsec_profile", None)
        if profile:
            shutil.rmtree(profile, ignore_errors=True)


def wait_for(probe: Callable[[], T], timeout_s: float = 30.0, what: str = "the page") -> T:
    """Poll `probe` until it returns something truthy (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got:
                return got
            last = got
        except Exception as e:      # the element is not there yet, or was replaced meanwhile
            last = e
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")


def login(driver: Any, base_url: str, key: str, timeout_s: float = 30.0) -> None:
    """Open the dashboard and log in with `key` through the form, as a person would."""
    from selenium.webdriver.common.by import By
    driver.get(f"{base_url}/ui/")
    field = wait_for(lambda: driver.find_element(By.ID, "key"), timeout_s, "the login form")
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
    wait_for(lambda: driver.find_element(By.ID, "top").is_displayed(), timeout_s, "the dashboard after login")
