"""Report benchmark: how long `ttft-relay report --html` takes on a big log, how large the
page is, and how long Chromium takes to open and draw it.

Builds a log of --records records shaped like a day of traffic (ttft_relay/testing/report_samples.py),
then, medians over --repeat runs each: the text report (the baseline, same run, same log),
the text report plus the HTML page, and in headless Chromium: navigation until the page says
it has drawn, the page's own drawing time, and picking a request from the table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from ttft_relay.testing import browser, report_samples

REPO = Path(__file__).resolve().parent.parent

REPORT = [sys.executable, "-m", "ttft_relay", "report"]


def timed_run(args: list[object]) -> float:
    t = time.perf_counter()
    subprocess.run([*REPORT, *args], check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        log, page_file = tmp / "timing.jsonl", tmp / "report.html"
        log.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in report_samples.day(args.records)))
        text_s = statistics.median(timed_run([log]) for _ in range(args.repeat))
        html_s = statistics.median(timed_run([log, "--html", page_file]) for _ in range(args.repeat))
        size = page_file.stat().st_size
        print(f"log: {args.records + 2} records, {log.stat().st_size / 2**20:.1f} MiB")
        print(f"ttft-relay report (text)        {text_s:6.2f} s")
        print(f"ttft-relay report --html        {html_s:6.2f} s   ({html_s / text_s:.2f}x the text report)")
        print(f"page size                         {size / 2**20:6.2f} MiB")
        if not browser.available():
            print(f"browser timings skipped: {browser.SKIP_REASON}")
            return 0
        opened, drawn, picked = [], [], []
        with browser.Browser(tmp / "profile") as chromium:
            for _ in range(args.repeat):
                t = time.perf_counter()
                page = chromium.open(page_file.as_uri())
                page.wait_for("document.body.dataset.rendered")
                opened.append(time.perf_counter() - t)
                drawn.append(page.evaluate("+document.body.dataset.renderMs") / 1000)
                t = time.perf_counter()
                page.evaluate("document.querySelectorAll('#requests tbody tr')[7].click()")
                page.wait_for("document.querySelector('.wf-row.picked')")
                picked.append(time.perf_counter() - t)
                page.call("Page.close")
        print(f"Chromium: open until drawn        {statistics.median(opened):6.2f} s")
        print(f"  of which the page's drawing     {statistics.median(drawn):6.2f} s")
        print(f"  pick a request from the table   {statistics.median(picked) * 1000:6.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
