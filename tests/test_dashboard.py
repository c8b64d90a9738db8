"""The /loom/ dashboard in a real browser (headless Chromium driven by
Selenium): it loads without console errors, its panels show the figures of
a known workload, a stall appears within 5 s, nothing secret is shown. A
screenshot is saved under build/test-artifacts/ when a check fails."""

import os
import re
import shutil
import tempfile
import time

import pytest

from loomtest.nginx import ROOT
from test_metrics import gw, put_config  # noqa: F401 (gw is a fixture)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHARTJS = "/usr/share/javascript/chart.js/chart.min.js"
ARTIFACTS = os.path.join(ROOT, "build", "test-artifacts")
SECRET = "qry-SECRET-41d7e0"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    webdriver = None


def missing():
    if webdriver is None:
        return "selenium not importable (Debian package python3-selenium)"
    if not os.access(CHROMIUM, os.X_OK):
        return "chromium not found (Debian package chromium)"
    if not os.access(CHROMEDRIVER, os.X_OK):
        return "chromedriver not found (Debian package chromium-driver)"
    if not os.path.exists(CHARTJS):
        return CHARTJS + " not found (Debian package libjs-chart.js)"
    return None


@pytest.fixture
def browser(request):
    why = missing()
    if why:
        pytest.skip(why)
    profile = tempfile.mkdtemp(prefix="loom-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-quic", "--no-first-run",
                 "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1200",
                 "--user-data-dir=" + profile):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            os.makedirs(ARTIFACTS, exist_ok=True)
            path = os.path.join(ARTIFACTS, request.node.name + ".png")
            driver.save_screenshot(path)
            print("screenshot: " + path)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def text(driver, css):
    # read in the page's own thread: the rows are rebuilt every refresh, so
    # an element found first and read after may be gone (stale)
    return driver.execute_script(
        "var e = document.querySelector(arguments[0]);"
        "return e ? e.innerText : null;", css)


def wait(driver, what, fn, timeout):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
            lambda d: fn(d))
    except TimeoutException:
        raise AssertionError("%s: not within %ss" % (what, timeout))


def severe(driver):
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_dashboard_shows_the_workload(gw, browser):  # noqa: F811
    d = browser
    d.get("http://127.0.0.1:%d/loom/" % gw.port)
    wait(d, "first refresh", lambda d: d.execute_script(
        "return window.loomUpdates") >= 1, 15)
    assert d.execute_script("return typeof Chart") == "function"

    put_config(gw, 1000)
    hashed = gw.get("/offload/hash?data=x&rounds=3").status == 200
    # every worker's events panel counts the 1,000 config events
    wait(d, "1,000 events", lambda d: [
        text(d, "#events-delivered-0"), text(d, "#events-delivered-1")]
        == ["1000", "1000"], 15)
    wait(d, "timer runs", lambda d: int(text(d, "#timers-runs-0") or 0) > 0
         and int(text(d, "#timers-runs-1") or 0) > 0, 10)
    # one message published per request: the 1,000 PUTs at least
    wait(d, "publish", lambda d: sum(
        int(text(d, "#publish-sent-%d" % i) or 0) for i in (0, 1)) >= 1000,
        15)
    if hashed:
        wait(d, "offload", lambda d: sum(
            int(text(d, "#offload-completed-%d" % i) or 0)
            for i in (0, 1)) == 1, 10)

    r = gw.get("/loom/demo/block?cpu_ms=200&socket_ms=50&token=" + SECRET)
    assert r.status == 200
    seen = time.time()
    wait(d, "the stall", lambda d: "/loom/demo/block" in (
        text(d, "#stall-list") or ""), 5)
    took = time.time() - seen
    stalls = text(d, "#stall-list")
    assert "hash_random_strings" in stalls or "blocking_receive" in stalls
    # "<duration> <kind> in <system call> GET <path>": words kept apart
    assert re.search(r"s (cpu|blocked|unknown)( in \w+( \d+)?)? "
                     r"GET /loom/demo/block(\n|$)", stalls, re.M), stalls
    assert d.find_element("css selector", "#flamegraph").get_attribute(
        "href").endswith("/loom/blocking?format=svg")
    assert SECRET not in d.page_source
    assert severe(d) == []
    # at 1,400 px every panel fits: no horizontal scrollbar
    wide = d.execute_script(
        "return Array.from(document.querySelectorAll('section'))"
        ".filter(function (s) { return s.scrollWidth > s.clientWidth; })"
        ".map(function (s) { return s.id + ' ' + s.scrollWidth + '>' +"
        " s.clientWidth; });")
    assert wide == [], wide
    print("stall shown %.2f s after the request" % took)
