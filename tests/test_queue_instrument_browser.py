"""The queue instrument page (R12) in a real headless Chromium.

The server runs in a subprocess on 127.0.0.1, port 0; Chromium is driven through
chromedriver by selenium, with an explicit driver path so that selenium never fetches
one. The two R12 scenarios are clicked through and the values read off the page.

Needs the Debian packages ``chromium`` and ``chromium-driver`` and the Python package
``selenium`` (``bash .ci/install_browser.sh`` installs them). Without them the tests
skip, except under CI (``CI`` set to true), where they fail: CI never skips them.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM_BINARY", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

# A small run to overlay: the measured backlog parts from the fluid model at t = 2 s.
RUN = {
    "configs": {
        "continuous": {
            "arrival_rate": 2.0,
            "service_rate": 3.0,
            "backlog": [[0, 4], [0.5, 3.5], [1, 3], [1.5, 2.7], [2, 3.2], [2.5, 3.0], [3, 2.6], [4, 2.0]],
        }
    }
}


def _missing() -> list[str]:
    missing = []
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"Chromium ({CHROMIUM}; Debian package chromium)")
    if not (os.path.isfile(CHROMEDRIVER) and os.access(CHROMEDRIVER, os.X_OK)):
        missing.append(f"chromedriver ({CHROMEDRIVER}; Debian package chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the Python package selenium")
    return missing


def _require_browser() -> None:
    missing = _missing()
    if not missing:
        return
    msg = "browser test needs " + ", ".join(missing) + " (run: bash .ci/install_browser.sh)"
    if IN_CI:
        pytest.fail("CI is set, so the browser test may not skip: " + msg, pytrace=False)
    pytest.skip(msg)


class _Server:
    """``python -m engine.instrument --serve`` in a subprocess; always reaped."""

    def __init__(self, run_file: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.instrument", "--serve", "--host", "127.0.0.1",
             "--port", "0", "--from-run", str(run_file)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._wait_url(timeout=30)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if m:
                return m.group(1)
        self.close()
        raise RuntimeError("queue instrument server did not start:\n" + "".join(self.output))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_file = tmp_path_factory.mktemp("run") / "RESULTS.json"
    run_file.write_text(json.dumps(RUN))
    srv = _Server(run_file)
    try:
        yield srv
    finally:
        srv.close()
    assert srv.proc.returncode is not None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--disable-extensions", "--hide-scrollbars",
                 "--window-size=1100,1700", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    log = tmp_path_factory.mktemp("chromedriver") / "chromedriver.log"
    service = Service(executable_path=CHROMEDRIVER, log_output=str(log))
    driver = webdriver.Chrome(service=service, options=opts)
    try:
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()  # ends Chromium and chromedriver
        service.stop()
        proc = getattr(service, "process", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# --------------------------------------------------------------------------------------
# page helpers: act like a user, wait for the page to finish its requests
# --------------------------------------------------------------------------------------
def _seq(driver) -> int:
    return int(driver.find_element("tag name", "body").get_attribute("data-seq"))


def _settle(driver, before: int, timeout: float = 15) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    def done(d):
        body = d.find_element("tag name", "body")
        return int(body.get_attribute("data-seq")) > before and body.get_attribute("data-pending") == "0"

    WebDriverWait(driver, timeout, poll_frequency=0.05).until(done)


def _click(driver, element_id: str) -> None:
    before = _seq(driver)
    driver.find_element("id", element_id).click()
    _settle(driver, before)


def _type(driver, element_id: str, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element("id", element_id)
    field.click()
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(text)


def _read(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text.strip()


def _open(driver, server) -> None:
    driver.get(server.url)
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 15, poll_frequency=0.05).until(
        lambda d: int(d.find_element("tag name", "body").get_attribute("data-seq")) >= 1
        and d.find_element("tag name", "body").get_attribute("data-pending") == "0"
    )


def _set_scenario(driver, arrival: str, service: str, predict_t: str) -> None:
    _click(driver, "reset")
    _type(driver, "arrival", arrival)
    _type(driver, "service", service)
    _type(driver, "predict-t", predict_t)
    _click(driver, "predict")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _screenshot(driver, path: Path) -> None:
    """Save a screenshot and check it is a real, non-empty PNG of the page."""
    assert driver.save_screenshot(str(path))
    data = path.read_bytes()
    w, h = _png_size(data)
    assert len(data) > 10_000 and w >= 800 and h >= 800, (len(data), w, h)
    print(f"screenshot: {path}")


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_scenario_growing_backlog(browser, server, tmp_path):
    """Reset, lambda=4, mu=3: predict backlog 6 at t=2; four Steps reach t=2, backlog 6."""
    _open(browser, server)
    assert _read(browser, "t") == "0" and _read(browser, "backlog") == "4"
    _set_scenario(browser, "4", "3", "2")
    assert _read(browser, "error") == ""
    assert _read(browser, "predicted-t") == "2"
    assert _read(browser, "predicted-backlog") == "6"
    assert _read(browser, "drain") == "never"
    assert _read(browser, "rates") == "4 / 3"
    seen = []
    for _ in range(4):
        _click(browser, "step")
        seen.append((_read(browser, "t"), _read(browser, "backlog")))
    assert seen == [("0.5", "4.5"), ("1", "5"), ("1.5", "5.5"), ("2", "6")]
    assert _read(browser, "error") == ""
    # the plot: the prediction line and one point per visited state (t = 0 and four steps)
    plot = browser.find_element("id", "plot")
    assert len(plot.find_elements("css selector", "circle.step-point")) == 5
    assert plot.find_element("css selector", "polyline.predicted").get_attribute("points")
    assert plot.find_elements("css selector", "path.prediction-mark")
    _screenshot(browser, tmp_path / "queue_instrument_growing.png")


@pytest.mark.timeout(180)
def test_scenario_draining_backlog(browser, server, tmp_path):
    """Reset, lambda=2, mu=3: predict drainage at t=4; eight Steps reach t=4, backlog 0."""
    _open(browser, server)
    _set_scenario(browser, "2", "3", "4")
    assert _read(browser, "error") == ""
    assert _read(browser, "predicted-backlog") == "0"
    assert _read(browser, "drain") == "4"
    for _ in range(8):
        _click(browser, "step")
    assert (_read(browser, "t"), _read(browser, "backlog")) == ("4", "0")
    plot = browser.find_element("id", "plot")
    assert len(plot.find_elements("css selector", "circle.step-point")) == 9
    assert plot.find_elements("css selector", "line.drain")
    # what the page says about its limits
    limits = _read(browser, "limits")
    for phrase in ("no batch slots", "solver coordinates", "cancellation events",
                   "GPU completion", "decode memory"):
        assert phrase in limits
    _screenshot(browser, tmp_path / "queue_instrument_draining.png")


@pytest.mark.timeout(180)
def test_reset_and_bad_rate(browser, server):
    _open(browser, server)
    _set_scenario(browser, "4", "3", "2")
    _click(browser, "step")
    _click(browser, "reset")
    assert (_read(browser, "t"), _read(browser, "backlog")) == ("0", "4")
    assert _read(browser, "predicted-backlog") == "–"  # the old prediction is gone
    _type(browser, "arrival", "-1")
    _click(browser, "step")
    assert "arrival rate must be >= 0" in _read(browser, "error")
    assert (_read(browser, "t"), _read(browser, "backlog")) == ("0", "4")  # nothing moved
    _type(browser, "arrival", "NaN")
    _click(browser, "predict")
    assert "arrival rate must not be NaN" in _read(browser, "error")


@pytest.mark.timeout(180)
def test_measured_run_overlay(browser, server):
    """--from-run: the measured series is drawn beside the fluid model, with where they part."""
    _open(browser, server)
    section = browser.find_element("id", "run")
    assert section.is_displayed()
    summary = _read(browser, "run-summary")
    assert "max |deviation| 2 requests at t = 4 s" in summary
    assert "stops holding at t = 2 s" in summary
    run_plot = browser.find_element("id", "run-plot")
    assert run_plot.find_element("css selector", "polyline.run-measured").get_attribute("points")
    assert run_plot.find_element("css selector", "polyline.run-fluid").get_attribute("points")
    assert run_plot.find_elements("css selector", "line.run-diverge")


@pytest.mark.timeout(30)
def test_browser_requirements_reported():
    """Under CI the browser stack must be present (so the tests above cannot skip)."""
    if IN_CI:
        assert not _missing(), "CI is set but the browser stack is missing: " + ", ".join(_missing())
    elif _missing():
        pytest.skip("browser stack missing: " + ", ".join(_missing()))
    assert shutil.which(CHROMIUM) or os.path.isfile(CHROMIUM)
