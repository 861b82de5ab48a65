"""Headless Chromium for end-to-end tests, driven over the DevTools protocol on a pipe.

Why this and not playwright or selenium: Debian's `chromium` is the browser people
have, and `--remote-debugging-pipe` lets the test talk to it over two file
descriptors with NUL-terminated JSON messages — no WebSocket client, no driver
binary, no browser download, no Python or npm dependency. The protocol calls used
(Target, Page, Runtime, Emulation) are the stable core of CDP.

    with Browser(tmp_path / "profile") as browser:
        page = browser.open("file:///.../report.html")
        page.wait_for("document.body.dataset.rendered")
        page.evaluate("document.querySelectorAll('rect.bar').length")
        page.screenshot(ARTIFACTS / "report.png")
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         "--font-render-hinting=none")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
"""Screenshots the browser tests take (gitignored; beside the package: a checkout's root): look at them."""
TIMEOUT_S = 30.0


def available() -> bool:
    return Path(CHROMIUM).exists() and os.access(CHROMIUM, os.X_OK)


SKIP_REASON = f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/test installs it when run as root)"


class BrowserError(Exception):
    pass


class Browser:
    """One Chromium process with a fresh profile; `open()` gives a Page per tab."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 900) -> None:
        self.profile = profile
        self.size = (width, height)
        self._ids = itertools.count(1)
        self._results: dict[int, dict[str, Any]] = {}
        self._events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._closed = False
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Browser:
        to_chrome_r, self._out = os.pipe()
        self._in, from_chrome_w = os.pipe()
        # Chromium reads commands from fd 3 and writes replies to fd 4; bash maps ours there (dash takes single-digit fds only).
        args = [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe",
                f"--window-size={self.size[0]},{self.size[1]}", "about:blank"]
        self.profile.mkdir(parents=True, exist_ok=True)
        self.log = self.profile / "chromium.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', "bash", *args],
                pass_fds=(to_chrome_r, from_chrome_w), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.proc and self.proc.poll() is None:
                self.send("Browser.close", timeout=5)
        except BrowserError:
            pass
        finally:
            if self.proc:
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            os.close(self._out)

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def _read(self) -> None:
        buffer = b""
        with os.fdopen(self._in, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                with self._cond:
                    for raw in messages:
                        msg = json.loads(raw)
                        if "id" in msg:
                            self._results[msg["id"]] = msg
                        else:
                            self._events.append(msg)
                    self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None,
             timeout: float = TIMEOUT_S) -> dict[str, Any]:
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._out, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"{method}: Chromium has exited; its log ends:\n{self.log_tail()}") from None
        with self._cond:
            if not self._cond.wait_for(lambda: msg_id in self._results or self._closed, timeout):
                raise BrowserError(f"{method}: no answer within {timeout} s")
            if msg_id not in self._results:
                raise BrowserError(f"{method}: the browser went away")
            reply = self._results.pop(msg_id)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def wait_event(self, method: str, session: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        def found():
            return next((e for e in self._events if e.get("method") == method and e.get("sessionId") == session), None)
        with self._cond:
            event = self._cond.wait_for(found, timeout)
            if event is None:
                raise BrowserError(f"no {method} within {timeout} s")
            self._events.remove(event)
            return event["params"]

    def open(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.call("Page.enable")
        page.call("Runtime.enable")
        page.call("Emulation.setDeviceMetricsOverride",
                  {"width": self.size[0], "height": self.size[1], "deviceScaleFactor": 1, "mobile": False})
        page.goto(url)
        return page


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        return self.browser.send(method, params, session=self.session, timeout=timeout)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.browser.wait_event("Page.loadEventFired", self.session)

    def evaluate(self, expression: str, timeout: float = TIMEOUT_S) -> Any:
        """The value of a JavaScript expression (a promise is awaited); a thrown error raises."""
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, timeout=timeout + 5)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout: float = TIMEOUT_S) -> Any:
        """Waits, inside the page, until the JavaScript `condition` is truthy; returns its value."""
        return self.evaluate(
            "new Promise((resolve, reject) => { const until = performance.now() + %d;"
            " (function check() { let v; try { v = (%s); } catch (e) {}"
            " if (v) return resolve(v); if (performance.now() > until) return reject(new Error(%s));"
            " setTimeout(check, 20); })(); })" % (timeout * 1000, condition, json.dumps(f"timed out waiting for {condition}")),
            timeout=timeout,
        )

    def click(self, selector: str) -> None:
        self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params |= {"captureBeyondViewport": True,
                       "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}}
        data = self.call("Page.captureScreenshot", params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
