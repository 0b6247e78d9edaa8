"""Headless Chromium for the browser tests, driven over the Chrome DevTools Protocol (CDP).

All it needs is Debian's `chromium` package (`apt-get install chromium`; .ci/run installs it) and
the `websockets` package, which uvicorn[standard] already brings: nothing is downloaded at run
time, and there is no driver binary whose version must match the browser's (chromedriver) and no
second copy of a browser (Playwright's). The price is this small client: a page, a script
evaluated in it, the JavaScript dialogs it opens (accepted, and remembered), the URLs it fetched,
and a screenshot. Chromium starts as the machine notes say it runs here: headless, without the
sandbox (CI runs as root), with every background connection off (the network is closed) and an
empty profile of its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import websockets

from poll import until

CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")


def find_chromium() -> str | None:
    """The browser to drive: $RAMJET_CHROMIUM, else Debian's chromium or another Chromium on PATH."""
    for name in (os.environ.get("RAMJET_CHROMIUM"), *CANDIDATES):
        if name and (found := shutil.which(name)):
            return found
    return None


class Page:
    """One tab, over one CDP session: evaluate, dialogs, fetched URLs, screenshots."""

    def __init__(self, ws, session: str):
        self._ws, self._session = ws, session
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.dialogs: list[str] = []     # the messages of the dialogs the page opened, all accepted
        self.requested: list[str] = []   # every URL the page asked for
        self.errors: list[str] = []      # exceptions thrown in the page and console errors
        self._reader = asyncio.create_task(self._read())

    async def send(self, method: str, session: bool = True, **params) -> dict:
        n = next(self._ids)
        done = self._waiting[n] = asyncio.get_running_loop().create_future()
        message = {"id": n, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        await self._ws.send(json.dumps(message))
        answer = await asyncio.wait_for(done, 30)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    async def _read(self) -> None:
        async for raw in self._ws:
            m = json.loads(raw)
            if "id" in m:
                waiter = self._waiting.pop(m["id"], None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(m)
                continue
            method, params = m.get("method"), m.get("params", {})
            if method == "Page.javascriptDialogOpening":  # a confirm(): the operator says yes
                self.dialogs.append(params.get("message", ""))
                await self._ws.send(json.dumps({"id": next(self._ids), "sessionId": self._session,
                                                "method": "Page.handleJavaScriptDialog",
                                                "params": {"accept": True}}))
            elif method == "Network.requestWillBeSent":
                self.requested.append(params["request"]["url"])
            elif method == "Runtime.exceptionThrown":
                self.errors.append(params["exceptionDetails"].get("exception", {}).get("description", "?"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))

    async def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails'].get('text')}: "
                               f"{result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await until(lambda: self.evaluate("document.readyState === 'complete'"), f"{url} loaded", timeout=30,
                    interval=0.05)

    async def wait(self, expression: str, what: str, timeout: float = 20.0):
        """Poll a JavaScript expression until it is truthy; its value."""
        return await until(lambda: self.evaluate(expression), what, timeout=timeout, interval=0.1)

    async def type_into(self, selector: str, text: str) -> None:
        """Focus an input and type into it, as a keyboard would (the text never appears in a URL)."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", text=text)

    async def click(self, selector: str) -> None:
        """Click an element; a dialog it opens (confirm) is accepted before this returns."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")

    async def screenshot(self, path: Path) -> None:
        """The whole page, as a PNG."""
        height = await self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        width = await self.evaluate("Math.ceil(document.documentElement.clientWidth)")
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                               clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


@contextlib.asynccontextmanager
async def chromium(workdir: Path, width: int = 1440, height: int = 900) -> AsyncIterator[Page]:
    """A headless Chromium with one blank page; stopped, with its whole process group, at the end."""
    exe = find_chromium()
    if exe is None:
        raise RuntimeError("no Chromium found")
    profile = workdir / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "chromium.log", "wb")
    proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                             "about:blank"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    page = None
    try:
        port_file = profile / "DevToolsActivePort"

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}; see {workdir / 'chromium.log'}")
            return port_file.exists() and len(port_file.read_text().split()) >= 2
        await until(started, "chromium's DevTools port", timeout=30, interval=0.05)
        port, path = port_file.read_text().split()[:2]
        ws = await websockets.connect(f"ws://127.0.0.1:{port}{path}", max_size=None, ping_interval=None)
        try:
            browser = Page(ws, "")
            target = await browser.send("Target.createTarget", session=False, url="about:blank")
            attached = await browser.send("Target.attachToTarget", session=False, targetId=target["targetId"],
                                          flatten=True)
            await browser.close()
            page = Page(ws, attached["sessionId"])
            for domain in ("Page", "Runtime", "Network"):
                await page.send(f"{domain}.enable")
            await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                            mobile=False)
            yield page
        finally:
            if page is not None:
                await page.close()
            await ws.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        log.close()
