"""The Space in a real browser: serve the page, open it in headless Chromium, press Generate, read what it renders.

Shared by the browser test (`tests/test_space.py`) and `screenshot.py`. Needs Chromium and its driver (Debian:
`apt-get install -y chromium chromium-driver`) and Selenium (the `test` extra), driving the system chromedriver, so
nothing is downloaded.
"""

import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from app import EXAMPLES, STAT_LABELS

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)
INSTALL_HINT = "install Chromium and its driver (`apt-get install -y chromium chromium-driver`) and Selenium"


class BrowserMissing(RuntimeError):
    """No Chromium, chromedriver or Selenium on this machine."""


@dataclass
class RenderedRun:
    """What the page showed once Generate had finished: the prompt, each statistic (`STAT_LABELS` keys) as rendered,
    the Osprey output's text and the target-only text."""

    prompt: str
    stats: dict[str, str]
    osprey_text: str
    target_text: str


def find_browser() -> tuple[str, str]:
    """The paths of Chromium and chromedriver; `BrowserMissing`, saying what to install, when one is absent."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    missing = [name for name, found in (("chromium", browser), ("chromedriver", driver)) if found is None]
    try:
        import selenium  # noqa: F401 (only checked for here)
    except ImportError:
        missing.append("selenium")
    if missing:
        raise BrowserMissing(f"No {', '.join(missing)} found: {INSTALL_HINT} (`pip install -e '.[test]'`).")
    return browser, driver


@contextmanager
def served(demo: gr.Blocks):
    """Serves `demo` on a free local port for the duration; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield demo.local_url
    finally:
        demo.close()


def press_generate(
    url: str,
    screenshot: Path,
    example: int | None = None,
    size: tuple[int, int] = (1280, 1620),
    timeout_s: float = 900,
) -> RenderedRun:
    """Opens the page at `url` in headless Chromium, clicks `EXAMPLES[example]` (None: keeps the prompt the page opens
    with), presses Generate, waits until the speedup is rendered (a finished run; models load on the first run, so
    that can take minutes) and saves a PNG screenshot of the window to `screenshot`. Raises `RuntimeError` with the
    page's message when the run fails, `TimeoutError` when nothing finishes within `timeout_s`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    browser, driver_path = find_browser()
    with tempfile.TemporaryDirectory() as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}"):
            options.add_argument(flag)
        options.page_load_strategy = "eager"  # the page is its scripts; web fonts it may ask for are not waited on
        driver = webdriver.Chrome(options=options, service=Service(driver_path))
        try:  # the page's viewport exactly `size` (the window's includes what headless Chromium keeps for its frame)
            metrics = {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": False}
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
            driver.get(url)
            _wait(driver, lambda: driver.find_elements(By.ID, "generate"), 120, "the page to load")
            if example is not None:
                _click_example(driver, example)
            prompt = _value(driver, "prompt")
            driver.find_element(By.ID, "generate").click()
            _wait(driver, lambda: _value(driver, "stat-speedup"), timeout_s, "Generate to finish")
            driver.execute_script("window.scrollTo(0, 0)")  # the capture shows the page from its top
            time.sleep(0.5)  # the last update's other outputs render with it; let them paint before the capture
            run = RenderedRun(
                prompt=prompt,
                stats={name: _value(driver, f"stat-{name}") for name in STAT_LABELS},
                osprey_text=driver.find_element(By.CSS_SELECTOR, "#osprey-output .textfield").text,
                target_text=_value(driver, "target-output"),
            )
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            if not driver.save_screenshot(str(screenshot)):
                raise RuntimeError(f"Chromium could not save a screenshot to {screenshot}.")
            return run
        finally:
            driver.quit()


def _click_example(driver, index: int) -> None:
    from selenium.webdriver.common.by import By

    if not 0 <= index < len(EXAMPLES):
        raise ValueError(f"No example {index}: the page has {len(EXAMPLES)}, numbered 0 to {len(EXAMPLES) - 1}.")
    buttons = driver.find_elements(By.CSS_SELECTOR, "#examples button")
    if len(buttons) != len(EXAMPLES):
        raise RuntimeError(f"Expected {len(EXAMPLES)} example buttons on the page, found {len(buttons)}.")
    buttons[index].click()
    expected = EXAMPLES[index][1]
    _wait(driver, lambda: _value(driver, "prompt") == expected, 30, f"example {index} to fill the prompt")


def _value(driver, elem_id: str) -> str:
    """The text in the Gradio textbox `#elem_id` (its textarea or input)."""
    return driver.execute_script(
        "const box = document.querySelector(arguments[0]); return box === null ? '' : box.value;",
        f"#{elem_id} textarea, #{elem_id} input",
    )


def _wait(driver, ready, timeout_s: float, what: str):
    """Polls `ready()` until it is truthy; raises the page's error message if one shows, or `TimeoutError`."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := ready():
            return result
        toasts = driver.find_elements(By.CSS_SELECTOR, ".toast-body.error")
        errors = [" ".join(toast.text.split()) for toast in toasts if toast.text]
        if errors:
            raise RuntimeError(f"The page showed an error while waiting for {what}: {' / '.join(errors)}")
        time.sleep(0.25)
    raise TimeoutError(f"Waited {timeout_s:.0f} s for {what}; nothing came.")
