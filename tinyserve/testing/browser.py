"""Headless Chromium for the playground's tests and screenshots, driven by Selenium.

Uses the system's browser and driver (Debian's ``chromium`` and ``chromium-driver``; paths
from $CHROMIUM / $CHROMEDRIVER or the PATH), never a downloaded one: Selenium Manager is
bypassed by naming the driver explicitly."""

from __future__ import annotations

import os
import shutil

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> tuple[str, str] | None:
    """(browser, driver) paths, or None when either is missing."""
    browser = os.environ.get("CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    driver = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_browser(width: int = 1400, height: int = 900):
    """A headless Chrome WebDriver at the given window size."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_browser()
    if found is None:
        raise RuntimeError(
            "no chromium + chromedriver found (apt-get install chromium chromium-driver)"
        )
    browser, driver = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)
