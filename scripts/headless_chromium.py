"""A page opened in headless Chromium, over the DevTools protocol on a pipe: stdlib only.

Used by tests/test_browser.py (do our HTML outputs render, do their images load, does the page log
errors?) and scripts/docs_images.py (the screenshots in docs/img/). Why not playwright or selenium:
both fetch or expect a browser build of their own; Debian's `chromium` package is enough, and the
protocol over `--remote-debugging-pipe` (NUL-terminated JSON on fds 3 and 4) needs neither a
websocket nor a free port.

    with Chromium() as browser:
        page = browser.open("reports/metrics.html")
        page.problems       # console errors, uncaught exceptions, failed loads: [] when all is well
        page.images()       # [{"src", "complete", "width", "height"}] of every <img> on the page
        page.screenshot("shot.png")
"""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

EXECUTABLES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The browser's path (`$CHROMIUM` first), or None when none is installed."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((p for p in map(shutil.which, EXECUTABLES) if p), None)


class Chromium:
    """One headless browser process; each `open` is a new tab."""

    def __init__(self, executable: str | None = None, *, width: int = 1000, height: int = 700, timeout: float = 60):
        executable = executable or find_chromium()
        if executable is None:
            raise FileNotFoundError(f"no Chromium found (tried {', '.join(EXECUTABLES)}; or set CHROMIUM): "
                                    "apt-get install chromium")
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="ddpmrepro-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def pipes_on_3_and_4():
            # The pipes may themselves sit on fds 3 or 4: copy them out of the way before dup2.
            r, w = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(r, 3)
            os.dup2(w, 4)

        # --no-sandbox: the suid sandbox needs privileges a container or a root CI job lacks.
        # --disable-gpu and --use-angle=swiftshader: render on the CPU the same way on every machine.
        self._proc = subprocess.Popen(
            [executable, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--use-angle=swiftshader", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--hide-scrollbars", f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}",
             "about:blank"],
            preexec_fn=pipes_on_3_and_4, close_fds=False, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._last_id = 0
        self._events: list[dict] = []
        self.size = (width, height)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.send("Browser.close", timeout=10)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._profile.cleanup()

    # --- the protocol: one command at a time, events kept in order of arrival --------------------

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float | None = None):
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error'].get('message', reply['error'])}")
                return reply.get("result", {})
            self._events.append(reply)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe (it exited)")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _wait_event(self, method: str, session: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method and event.get("sessionId") == session:
                    return self._events.pop(i)
            self._events.append(self._receive(deadline))

    def _drain(self, seconds: float) -> None:
        """Reads whatever events arrive in the next `seconds` (late console messages, image loads)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._events.append(self._receive(deadline))
            except TimeoutError:
                return

    def open(self, path_or_url: str | Path, *, settle: float = 0.5) -> "Page":
        """A new tab showing the page, after its load event and `settle` seconds of scripts running."""
        url = str(path_or_url)
        if "://" not in url:
            url = Path(url).resolve().as_uri()
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        # The page gets exactly width x height (--window-size counts the invisible window's frame too).
        width, height = self.size
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        navigation = self.send("Page.navigate", {"url": url}, session=session)
        if navigation.get("errorText"):
            raise RuntimeError(f"{url}: {navigation['errorText']}")
        self._wait_event("Page.loadEventFired", session)
        page = Page(self, session, url)
        page.wait(settle)
        return page


class Page:
    """One tab: what went wrong while it loaded and ran, its images, JavaScript, screenshots."""

    def __init__(self, browser: Chromium, session: str, url: str):
        self._browser, self._session, self.url = browser, session, url

    def wait(self, seconds: float) -> None:
        self._browser._drain(seconds)

    @property
    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions, browser log errors, failed requests and HTTP errors, as lines."""
        found = []
        for event in self._browser._events:
            if event.get("sessionId") != self._session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                found.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                found.append(f"console.{params['type']}: {text}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(f"log: {params['entry'].get('text')} ({params['entry'].get('url', '')})")
            elif method == "Network.loadingFailed" and not params.get("canceled"):
                found.append(f"failed to load: {params.get('errorText')} ({params.get('type')})")
            elif method == "Network.responseReceived" and params["response"].get("status", 200) >= 400:
                found.append(f"HTTP {params['response']['status']}: {params['response'].get('url')}")
        return found

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        reply = self._browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                         "awaitPromise": True}, session=self._session)
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            raise RuntimeError(f"{expression[:60]}...: {details.get('exception', {}).get('description') or details.get('text')}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30):
        """Polls a JavaScript expression until it is truthy (a click's effect, a late image); its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s on {self.url}: {expression}")
            self.wait(0.05)
        return value

    def images(self) -> list[dict]:
        """Every <img>: `complete` with a non-zero natural size means it loaded and decoded."""
        return self.evaluate("Array.from(document.images).map(i => ({src: i.currentSrc.slice(0, 80), "
                             "complete: i.complete, width: i.naturalWidth, height: i.naturalHeight}))")

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''")

    def click(self, css: str, containing: str = "") -> None:
        """Clicks the first element matching `css` whose text contains `containing`."""
        found = self.evaluate(f"""(() => {{
            const el = Array.from(document.querySelectorAll({json.dumps(css)}))
                .find(e => e.textContent.includes({json.dumps(containing)}));
            if (el) el.click();
            return Boolean(el); }})()""")
        if not found:
            raise LookupError(f"no {css!r} containing {containing!r} on {self.url}")

    def screenshot(self, path: str | Path, *, full_page: bool = False) -> Path:
        params: dict = {"format": "png"}
        if full_page:
            height = self.evaluate("document.documentElement.scrollHeight")
            params["clip"] = {"x": 0, "y": 0, "width": self._browser.size[0], "height": height, "scale": 1}
            params["captureBeyondViewport"] = True
        data = self._browser.send("Page.captureScreenshot", params, session=self._session)["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)
