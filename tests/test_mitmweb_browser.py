"""mitmweb in a real headless Chromium: the relay's timing in the flow list without a
click (the Comment column), slow flows marked with a symbol ordinary fonts draw, and
the event-stream view with each event's arrival time.

Screenshots land in test-artifacts/ (gitignored) for a person to look at.
"""

from __future__ import annotations

import re

import pytest

from ttft_relay.timing import phases, record
from ttft_relay.workers import free_port
from ttft_relay.testing import browser
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import MITMWEB, MitmdumpProcess

pytestmark = pytest.mark.skipif(not browser.available(), reason=browser.SKIP_REASON)

PASSWORD = "correct-horse-battery"
BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}
SLOW_MS = 1000  # well above a fast flow on a loaded machine (one took 365 ms)


def relay_a_stream(relay: MitmdumpProcess, prefill_ms: int) -> None:
    chunks = list(client.stream_post(relay.url() + "/v1/chat/completions", BODY, {"x-fake-prefill-ms": str(prefill_ms)}))
    assert b"Hello" in b"".join(c.data for c in chunks)


def rows(page) -> list[dict]:
    return page.evaluate("""[...document.querySelectorAll('.flow-table tbody tr')].filter((tr) => tr.querySelector('.col-path'))
        .map((tr) => ({comment: (tr.querySelector('.col-comment') || {}).textContent,
                       marker: tr.querySelector('.col-path .marker').textContent,
                       path: tr.querySelector('.col-path').textContent}))""")


def test_mitmweb_lists_timing_marks_slow_flows_and_times_events(fake, confdir, tmp_path):
    web_port = free_port()
    relay = MitmdumpProcess([reverse_to(fake)], confdir, options={
        "web_port": web_port, "web_open_browser": "false", "web_password": PASSWORD,
        "relay_slow_ms": SLOW_MS, "relay_timing_log": tmp_path / "timing.jsonl"})
    relay.args[0] = str(MITMWEB)
    with relay.start(), browser.Browser(tmp_path / "profile", height=700) as chromium:
        relay.wait_for_output("Web server listening")
        relay_a_stream(relay, prefill_ms=SLOW_MS + 200)
        relay_a_stream(relay, prefill_ms=0)
        page = chromium.open(f"http://127.0.0.1:{web_port}/?token={PASSWORD}")
        page.wait_for("document.querySelectorAll('.flow-table td.col-comment').length == 2 && "
                      "[...document.querySelectorAll('.flow-table td.col-comment')].every((td) => td.textContent)")
        headers = page.evaluate("[...document.querySelectorAll('.flow-table thead th')].map((th) => th.textContent.trim())")
        assert "Comment" in headers
        slow, fast = rows(page)
        # The verdict and its number first, as on the console: "ok · SLOW: ttft 1.2 s", then the
        # verdict's sentence; a new relay blames nobody while it learns the model:
        # "ok: first token 1.2 s, nothing out of line (learning this upstream · model: 0 of 8 requests)"
        assert slow["comment"].startswith(f"{phases.OK} · "), slow
        assert "(learning this upstream · model: 0 of 8 requests)" in slow["comment"], slow
        assert f"{record.SLOW_WORD}: ttft " in slow["comment"] and f"{record.SLOW_WORD}:" not in fast["comment"]
        assert float(re.search(r"first token ([\d.]+) s", slow["comment"]).group(1)) * 1000 >= SLOW_MS
        assert slow["marker"] == "\u26a0"  # ⚠: no emoji font needed (DejaVu Sans has it)
        assert re.match(r"ok · ttft \d+ ms\.\s*ok: first token \d+ ms, nothing out of line", fast["comment"]), fast
        assert fast["marker"] == ""
        browser.ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(browser.ARTIFACTS / "mitmweb-list.png", full_page=False)
        # Readable where mitmweb cuts the 150 px column: the verdict's words end inside the cell (it was
        # "ttft 2007 ms → up…").
        for row, words in ((0, "ok"), (1, "ok")):
            inside = page.evaluate(f"""(() => {{ const td = document.querySelectorAll('.flow-table td.col-comment')[{row}];
                const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT); const text = walker.nextNode();
                const range = document.createRange(); range.setStart(text, 0); range.setEnd(text, {len(words)});
                return range.getBoundingClientRect().right <= td.getBoundingClientRect().right; }})()""")
            assert inside, f"{words!r} is cut in the Comment column"

        page.evaluate("document.querySelector('.flow-table tbody tr td.col-path').click()")
        page.wait_for("[...document.querySelectorAll('.flow-detail nav a, .flow-detail .nav-tabs a')]"
                      ".some((a) => a.textContent.trim() == 'Response')")
        page.evaluate("[...document.querySelectorAll('.flow-detail nav a, .flow-detail .nav-tabs a')]"
                      ".find((a) => a.textContent.trim() == 'Response').click()")
        text = page.wait_for(r"/\+\d+\.\d ms\s+chat\.completion|\+\d+\.\d ms\s+\{/.test(document.querySelector('.flow-detail').innerText)"
                             " && document.querySelector('.flow-detail').innerText")
        page.screenshot(browser.ARTIFACTS / "mitmweb-events.png", full_page=False)
        timed = [(float(ms), line) for ms, line in re.findall(r"\+(\d+\.\d) ms\s+(.*)", text)]
        assert len(timed) >= 3 and [ms for ms, _ in timed] == sorted(ms for ms, _ in timed)
        first_text = next(ms for ms, line in timed if '"content":"' in line and '"content":""' not in line)
        # The fake sends the role chunk at once, then waits its prefill before the first text.
        assert first_text >= SLOW_MS + 200
        assert first_text - timed[0][0] >= SLOW_MS
