"""The HTML report opened in a real headless Chromium: the waterfall bars of a known
request, the plots, the table that picks any request, and nothing fetched.

Screenshots land in test-artifacts/ (gitignored) for a person to look at.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import orjson
import pytest

from ttft_relay.testing import browser, report_samples
from ttft_relay.testing.harness import REPO

pytestmark = pytest.mark.skipif(not browser.available(), reason=browser.SKIP_REASON)

KNOWN = "known-slow"


PREFILL_GAP = "known-prefill-gap"


def known_record() -> dict:
    """The slowest request of the log, with phases the test can check bar by bar; its longest
    gap (900 ms) came after the first token."""
    marks = {"request_body": 3.0, "forwarded": 5.0, "upstream_connect_start": 5.5, "upstream_tcp": 40.0,
             "upstream_tls": 75.0, "response_head": 60075.0, "first_byte": 60076.0, "longest_gap": 61000.0,
             "first_event": 60076.0, "first_token": 60400.0, "last_token": 63000.0, "end": 63002.0}
    return report_samples.build(KNOWN, report_samples.DAY_START + 40000, "api.openai.com", "gpt-4o-mini", marks,
                                prompt=30000, rtt=35.0, max_gap=900.0, new_connection=True)


def prefill_gap_record() -> dict:
    """A request whose longest silence was its prefill: head and first byte at once, the first token 2 s later."""
    marks = {"request_body": 1.0, "forwarded": 2.0, "response_head": 40.0, "first_byte": 41.0, "longest_gap": 41.0,
             "first_event": 41.0, "first_token": 2041.0, "last_token": 2500.0, "end": 2501.0}
    return report_samples.build(PREFILL_GAP, report_samples.DAY_START + 50000, "api.openai.com", "gpt-4o-mini",
                                marks, prompt=3000, rtt=35.0, max_gap=2000.0)


def routed_records() -> list[dict]:
    """Two requests of an upstream group (api.openai.com and its member b): one chosen and
    served by b, its late head not hedged, one that left api.openai.com on a 503 for b."""
    marks = {"request_body": 1.0, "forwarded": 2.0, "response_head": 300.0, "first_byte": 301.0,
             "first_token": 320.0, "last_token": 900.0, "end": 901.0}
    route = {"group": "api.openai.com", "upstream": "b", "why": "lowest expected first token", "reason": "lowest",
             "expected_ms": {"api.openai.com": 900.0, "b": 300.0}}
    failed = [{"upstream": "api.openai.com", "error": "503", "cause": "5xx", "after_ms": 80.0}]
    return [report_samples.build(f"routed-{i}", report_samples.DAY_START + 30000 + i, "b.example.com", "gpt-4o-mini",
                                 marks, prompt=4000) | {"route": route | extra}
            for i, extra in enumerate([{"not_hedged": "api.openai.com expected 0.9 s, b 0.3 s more"},
                                       {"reason": "sticky", "failed_over": failed}])]


@pytest.fixture(scope="module")
def report_page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    records = report_samples.day(400) + [known_record(), prefill_gap_record(), *routed_records()]
    log = tmp / "timing.jsonl"
    log.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    out = tmp / "report.html"
    subprocess.run([sys.executable, "-m", "ttft_relay", "report", log, "--html", out, "--slowest", "8"],
                   check=True, capture_output=True, cwd=REPO)
    with browser.Browser(tmp / "profile") as chromium:
        page = chromium.open(out.as_uri())
        page.wait_for("document.body.dataset.rendered")
        yield page, records


def bars(page, selector: str) -> dict[str, dict]:
    return page.evaluate(f"""Object.fromEntries([...document.querySelectorAll({selector!r} + ' rect.bar:not(.unfinished)')].map(
        (r) => [r.dataset.phase, {{ms: +r.dataset.ms, x: +r.getAttribute('x'), w: +r.getAttribute('width')}}]))""")


def test_the_slowest_waterfall_shows_the_known_request_bar_by_bar(report_page):
    page, records = report_page
    rec = next(r for r in records if r["id"] == KNOWN)
    rows = page.evaluate("[...document.querySelectorAll('section svg.waterfall')[0].querySelectorAll('.wf-row')].map((g) => g.dataset.id)")
    assert len(rows) == 8 and rows[0] == KNOWN
    first_row = f'section svg.waterfall .wf-row[data-id="{KNOWN}"]'
    got = bars(page, first_row)
    expected = {name: ms for name, ms in rec["phases"].items() if name not in ("ttft", "total") and ms > 0}
    assert {k: v["ms"] for k, v in got.items()} == pytest.approx(expected, abs=0.05)
    # One shared time axis: widths are in proportion to the durations, bars follow each other.
    scale = got["upstream_wait"]["w"] / got["upstream_wait"]["ms"]
    assert got["stream"]["w"] / got["stream"]["ms"] == pytest.approx(scale, rel=0.01)
    # (a bar is at least 1 px wide, so where the next one starts says more than where this one ends)
    assert got["upstream_wait"]["x"] - got["upstream_tls"]["x"] == pytest.approx(got["upstream_tls"]["ms"] * scale, abs=0.5)
    assert got["stream"]["x"] - got["upstream_wait"]["x"] == pytest.approx(
        (got["upstream_wait"]["ms"] + got["head_to_first_token"]["ms"]) * scale, abs=0.5)
    tick = page.evaluate(f"+document.querySelector('{first_row} line.tick.first_token').dataset.ms")
    assert tick == pytest.approx(rec["marks"]["first_token"], abs=0.05)
    verdict = page.evaluate(f"document.querySelector('{first_row} text.verdict').textContent")
    assert verdict == rec["verdict"]
    gap = page.evaluate(f"(({{dataset}}) => [+dataset.from, +dataset.ms, dataset.where])("
                        f"document.querySelector('{first_row} path.gap'))")
    assert gap == [61000.0, 900.0, "after the first token"]  # the 900 ms gap, where it happened


def test_the_longest_gap_is_drawn_where_it_happened_even_before_the_first_token(report_page):
    page, _ = report_page
    page.evaluate(f"""(() => {{ const i = document.querySelector('.controls input'); i.value = '{PREFILL_GAP}';
                     i.dispatchEvent(new Event('input')); }})()""")
    page.click("#requests tbody tr")
    row = "section:nth-of-type(2) svg.waterfall .wf-row"
    page.wait_for(f"!!document.querySelector('{row}[data-id=\"{PREFILL_GAP}\"]')")
    drawn = page.evaluate(f"""(() => {{ const g = document.querySelector('{row} path.gap');
        const at = (name) => +document.querySelector('{row} line.tick.' + name).getAttribute('x1');
        const [x0, x1] = g.getAttribute('d').match(/M([\\d.]+) [\\d.]+v2h([\\d.]+)/).slice(1).map(Number);
        return {{from: x0, to: x0 + x1, byte: at('first_byte'), token: at('first_token'), where: g.dataset.where}}; }})()""")
    # Before: drawn from the first token on, 2 s into a stream that ended 0.5 s later.
    assert drawn["where"] == "before the first token"
    assert drawn["from"] == pytest.approx(drawn["byte"], abs=1) and drawn["to"] == pytest.approx(drawn["token"], abs=1)


def test_time_axes_have_a_tick_at_or_above_their_largest_value(report_page):
    page, records = report_page
    ticks, y_max = page.evaluate("(({dataset}) => [JSON.parse(dataset.yTicks), +dataset.yMax])("
                                 "document.getElementById('ttft-over-time'))")
    assert y_max == max(r["ttft_ms"] for r in records if r["ttft_ms"] is not None and not r.get("prewarm"))
    assert y_max > 1000 and ticks[-1] >= y_max and any(t > 1000 for t in ticks), ticks  # not "no tick above 1 s"
    axis_max, last_tick = page.evaluate("""(() => { const svg = document.querySelector('svg.waterfall');
        const labels = [...svg.querySelectorAll('.axis text')].map((t) => t.textContent);
        return [+svg.dataset.axisMax, labels[labels.length - 1]]; })()""")
    assert axis_max >= 63002.0 and last_tick == f"{axis_max / 1000:.1f} s"


def test_plots_draw_every_request_and_every_group(report_page):
    page, records = report_page
    dots = page.evaluate("+document.getElementById('ttft-over-time').dataset.points")
    assert dots == sum(1 for r in records if not r.get("prewarm") and (r["ttft_ms"] is not None or "end" in r["marks"]))
    groups = {f"{r['upstream']} · {r['model']}" for r in records}
    bar_groups = page.evaluate("[...new Set([...document.querySelectorAll('svg.percentiles .pbar')].map((g) => g.dataset.group))]")
    assert set(bar_groups) == groups
    legend = page.evaluate("[...document.querySelectorAll('section .legend')].map((l) => l.textContent).join(' | ')")
    assert "ms per 1k uncached tokens" in legend and "websocket handshake failed (1)" in legend
    assert page.evaluate("document.querySelectorAll('svg.buckets g.bucket').length") > 10


def test_an_upstream_group_gets_a_row_per_member(report_page):
    page, _ = report_page
    rows = page.evaluate("[...document.querySelectorAll('table.members tbody tr')].map((tr) => "
                         "[...tr.cells].map((td) => td.textContent))")
    assert [row[:3] for row in rows] == [["api.openai.com", "1", "0"], ["b", "1", "2"]]
    assert rows[0][-4:] == ["5xx 1", "–", "–", "4000"] and rows[1][3] == "320 ms" and rows[1][7] == "lowest 1"
    assert rows[1][-2] == "hedge 1"  # b's late head waited for instead of a hedge
    heading = page.evaluate("document.querySelector('table.members').previousElementSibling.textContent")
    assert heading == ("api.openai.com: 2 requests, 1 failed over before the head, 0 hedged, 1 late heads waited for, "
                       "4000 prompt tokens sent again")


def test_a_request_picked_from_the_table_gets_its_own_waterfall(report_page):
    page, records = report_page
    target = next(r for r in records if r["id"] == "hs-failed")
    page.evaluate("""(() => { const i = document.querySelector('.controls input'); i.value = 'hs-failed';
                     i.dispatchEvent(new Event('input')); })()""")
    assert page.evaluate("document.querySelectorAll('#requests tbody tr').length") == 1
    page.click("#requests tbody tr")
    picked = page.wait_for("document.querySelector('section svg.waterfall .wf-row.picked') && "
                           "[...document.querySelectorAll('section')].find((s) => s.querySelector('h2').textContent === "
                           "'Request hs-failed') !== undefined")
    assert picked
    got = bars(page, "section:nth-of-type(2) svg.waterfall .wf-row")
    assert {k: v["ms"] for k, v in got.items()} == pytest.approx(
        {k: v for k, v in target["phases"].items() if k not in ("ttft", "total", target["error_phase"]) and v > 0},
        abs=0.05)
    assert page.evaluate("!!document.querySelector('section:nth-of-type(2) path.err')")  # the failure is marked
    # The phase it failed in ran on to the error: its bar is drawn unfinished, up to the error.
    unfinished = page.evaluate("(({dataset}) => [dataset.phase, +dataset.ms])("
                               "document.querySelector('section:nth-of-type(2) rect.bar.unfinished'))")
    assert unfinished == [target["error_phase"], pytest.approx(target["phases"][target["error_phase"]], abs=0.1)]
    assert target["phases"]["total"] == pytest.approx(
        sum(v for k, v in target["phases"].items() if k not in ("ttft", "total")), abs=0.1)
    browser.ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(browser.ARTIFACTS / "report.png")


def test_the_page_fetches_nothing(report_page):
    page, _ = report_page
    assert page.evaluate("performance.getEntriesByType('resource').length") == 0


def test_diagnose_html_draws_each_probe_as_its_own_waterfall(fake, tmp_path):
    fake.behaviour.prefill_ms = 120
    out = tmp_path / "diagnosis.html"
    done = subprocess.run([sys.executable, "-m", "ttft_relay", "diagnose", "--upstream", fake.base_url,
                           "--repeat", "2", "--long-tokens", "300", "--json", "--html", out],
                          capture_output=True, check=True, env={**os.environ, "OPENAI_API_KEY": "sk-test"}, cwd=REPO)
    probes = orjson.loads(done.stdout)["probes"]
    with browser.Browser(tmp_path / "profile") as chromium:
        page = chromium.open(out.as_uri())
        page.wait_for("document.body.dataset.rendered")
        labels = page.evaluate("[...document.querySelectorAll('svg.waterfall .wf-row')].map((g) => g.dataset.id)")
        tries = Counter()
        expected_labels = []
        for p in probes:  # a successful warm-up is dropped: these are the measured tries
            tries[p["path"], p["prompt"]] += 1
            expected_labels.append(f"{p['path']} {p['prompt']} #{tries[p['path'], p['prompt']]}")
        assert sorted(labels) == sorted(expected_labels) and len(labels) == 4
        first = next(p for p in probes if (p["path"], p["prompt"]) == ("direct", "tiny"))
        got = bars(page, 'svg.waterfall .wf-row[data-id="direct tiny #1"]')
        expected = {k: round(v, 1) for k, v in first["phases"].items()  # the page keeps 0.1 ms
                    if k not in ("ttft", "total") and round(v, 1) > 0}
        assert {k: v["ms"] for k, v in got.items() if k != "stream"} == pytest.approx(expected, abs=0.01)
        assert got["head_to_first_token"]["ms"] >= 100  # the prefill
        verdict = page.evaluate("document.querySelector('.verdict-line').textContent")
        assert verdict.startswith("verdict: ") or verdict == "nothing stands out"
        listed = page.evaluate("[...document.querySelectorAll('ul.findings li')].map((li) => li.textContent)")
        (context,) = [f for f in listed if f.startswith("context length: ")]
        assert context.startswith(("context length: every ", "context length: a prompt "))  # a rate, no cost: unweighed
        page.screenshot(browser.ARTIFACTS / "diagnose.png")


@pytest.mark.parametrize("lines", [[], [b'{"cut short']], ids=["empty log", "only a broken line"])
def test_a_log_without_records_still_gives_a_page_that_draws(tmp_path, lines):
    log = tmp_path / "timing.jsonl"
    log.write_bytes(b"\n".join(lines))
    out = tmp_path / "report.html"
    subprocess.run([sys.executable, "-m", "ttft_relay", "report", log, "--html", out], check=True, capture_output=True,
                   cwd=REPO)
    with browser.Browser(tmp_path / "profile") as chromium:
        page = chromium.open(out.as_uri())
        page.wait_for("document.body.dataset.rendered", timeout=10)
        assert page.evaluate("document.querySelectorAll('.wf-row').length") == 0
        assert "0 records" in page.evaluate("document.body.innerText")


def test_the_page_fits_a_phone_and_colours_verdicts_by_meaning(report_page, tmp_path):
    page, _ = report_page
    # The verdicts' legend (first token over time): each verdict and its colour.
    colours = page.evaluate("""Object.fromEntries([...document.querySelectorAll('.legend span')]
        .filter((span) => / \\(\\d+\\)$/.test(span.textContent))
        .map((span) => [span.textContent.replace(/ \\(\\d+\\)$/, ''), span.querySelector('i').style.background]))""")
    assert colours["ok"] == "rgb(39, 174, 96)"  # green: it was drawn in the palette's orange
    assert colours["upstream wait (prefill/queue)"] == "rgb(46, 134, 193)"  # the model's own time: blue
    assert colours["stream stall"] == "rgb(230, 126, 34)"  # a hop out of line: warm
    assert colours["error in response body"] == "rgb(192, 57, 43)"  # a failure: red
    out = next(iter(page.evaluate("[location.href]"))).removeprefix("file://")
    with browser.Browser(tmp_path / "phone", width=390, height=844) as phone:
        small = phone.open(f"file://{out}")
        small.wait_for("document.body.dataset.rendered")
        # The charts were 1180 px wide on the page itself: now each scrolls within its section.
        width = small.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1] == 390, width
        browser.ARTIFACTS.mkdir(exist_ok=True)
        small.screenshot(browser.ARTIFACTS / "report-phone.png", full_page=False)
