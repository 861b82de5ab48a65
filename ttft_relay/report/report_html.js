// Draws the ttft-relay report from the JSON in <script id="data"> (see ttft_relay/report/report_html.py).
// No dependencies, no network: SVG for waterfalls and bars, canvas for the scatter plots.
"use strict";
(function () {
  const t_start = performance.now();
  const D = JSON.parse(document.getElementById("data").textContent);
  const C = D.col, N = C.id.length, P = D.phases.length, M = D.marks.length;
  const PHASE_COLORS = {
    client_upload: "#7fb3d5", relay: "#af7ac5", relay_queue: "#d7bde2", upstream_connect: "#f5b041",
    upstream_tls: "#dc7633", upstream_upload: "#eb984e", upstream_wait: "#2e86c1", head_to_first_token: "#48c9b0",
    response_body: "#58d68d", stream: "#a9dfbf",
    dns: "#aab7b8", tcp: "#f5b041", tunnel: "#f8c471", tls: "#dc7633", send: "#7fb3d5", wait: "#2e86c1",
  };
  const PALETTE = ["#2e86c1", "#e67e22", "#27ae60", "#c0392b", "#8e44ad", "#16a085", "#d4ac0d",
    "#7f8c8d", "#e84393", "#34495e", "#a04000", "#1abc9c"];
  const phaseColor = (name, k) => PHASE_COLORS[name] || PALETTE[k % PALETTE.length];
  // Verdicts coloured by meaning: ok green; the model's own time (a long prompt, a cache miss, a
  // wait not yet told apart) blues; a hop out of line warm colours; a failure reds.
  const MEANINGS = [
    [/^ok$/, ["#27ae60"]],
    [/fail|error|abort/, ["#c0392b", "#e74c3c", "#922b21", "#f1948a", "#78281f"]],
    [/^(context length|prompt cache miss|upstream wait)/, ["#2e86c1", "#5dade2", "#1b4f72", "#85c1e9"]],
    [/./, ["#e67e22", "#d4ac0d", "#a04000", "#8e44ad", "#e84393", "#f5b041", "#6e2c00", "#b7950b"]],
  ];
  const VCOL = (() => {
    const used = MEANINGS.map(() => 0);
    return D.verdicts.map((v) => { const k = MEANINGS.findIndex(([rx]) => rx.test(v)), colors = MEANINGS[k][1];
      return colors[used[k]++ % colors.length]; });
  })();
  const verdictColor = (v) => VCOL[v];
  const groupColor = (g) => g < 8 ? PALETTE[g] : "#b2babb";
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  const fmtMs = (ms) => ms == null ? "–" : ms >= 10000 ? (ms / 1000).toFixed(1) + " s" : Math.round(ms) + " ms";
  const app = document.getElementById("app");
  const ph = (i, k) => C.ph[i * P + k];
  const mk = (i, name) => C.mk[i * M + D.marks.indexOf(name)];

  function niceTicks(lo, hi, count) {
    const span = hi - lo || 1, raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= raw);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(+v.toFixed(6));
    return out;
  }
  // An axis from lo to the first tick at or above hi: its largest value is never above its last tick.
  function niceAxis(lo, hi, count) {
    let ticks = niceTicks(lo, hi, count);
    const step = ticks.length > 1 ? ticks[1] - ticks[0] : (hi - lo || 1);
    while (!ticks.length || ticks[ticks.length - 1] < hi - 1e-9) ticks = ticks.concat([+((ticks.length ? ticks[ticks.length - 1] : lo) + step).toFixed(6)]);
    return { lo, hi: ticks[ticks.length - 1], ticks };
  }
  function el(tag, attrs, html) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (html != null) e.innerHTML = html;
    return e;
  }
  function section(title, note) {
    const s = el("section");
    s.appendChild(el("h2", {}, esc(title)));
    if (note) s.appendChild(el("p", { class: "note" }, note));
    app.appendChild(s);
    return s;
  }
  function legend(items) {
    return el("div", { class: "legend" }, items.map(([color, label]) =>
      `<span><i style="background:${color}"></i>${esc(label)}</span>`).join(""));
  }
  function label(i) {
    const kind = C.kind[i] ? ` [${C.kind[i]}]` : "";
    return D.kind === "diagnose" ? C.id[i] : `${D.groups[C.g[i]]}${kind}`;
  }

  // --- waterfalls ---------------------------------------------------------------------
  function rowEnd(i) {
    let x = C.s[i] || 0;
    for (let k = 0; k < P; k++) x += ph(i, k) || 0;
    return Math.max(x, mk(i, "end") || 0);
  }
  function waterfall(rows, opts) {
    const W = opts.width || 1180, LW = 300, RW = 250, RH = 24, top = 22;
    const axis = niceAxis(Math.min(0, ...rows.map((i) => C.s[i] || 0)), Math.max(1, ...rows.map(rowEnd)), 8);
    const lo = axis.lo, hi = axis.hi;
    const x = (ms) => LW + (ms - lo) / (hi - lo) * (W - LW - RW);
    const H = top + rows.length * RH + 6;
    let s = `<svg class="waterfall" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" data-rows="${rows.length}" ` +
      `data-axis-max="${hi}">`;
    s += `<g class="axis">`;
    for (const t of axis.ticks) {
      s += `<line class="grid" x1="${x(t)}" x2="${x(t)}" y1="${top - 4}" y2="${H}"/>` +
        `<text x="${x(t)}" y="${top - 8}" text-anchor="middle">${fmtMs(t)}</text>`;
    }
    s += `</g>`;
    rows.forEach((i, r) => {
      const y = top + r * RH, by = y + 5, bh = RH - 10;
      s += `<g class="wf-row" data-index="${i}" data-id="${esc(C.id[i])}">`;
      s += `<rect class="rowbg" x="0" y="${y}" width="${W}" height="${RH}" fill="transparent"/>`;
      const head = opts.rank ? `${r + 1}. ` : "";
      s += `<text x="4" y="${y + 16}">${esc(head + fmtMs(C.ttft[i]))}  ${esc(label(i)).slice(0, 46)}</text>`;
      let at = C.s[i] || 0;
      const failedIn = D.errors[i] != null ? (D.error_phases || {})[i] : null;
      for (let k = 0; k < P; k++) {
        const d = ph(i, k);
        if (d == null) continue;
        const name = D.phases[k];
        if (d > 0 && name === failedIn) {  // the phase it failed in runs on to the error: unfinished
          s += `<rect class="bar unfinished" data-phase="${name}" data-ms="${d}" x="${x(at)}" y="${by}" ` +
            `width="${Math.max(1, x(at + d) - x(at))}" height="${bh}" fill="${phaseColor(name, k)}" ` +
            `fill-opacity="0.3" stroke="#c0392b" stroke-dasharray="4 2"><title>${esc(name)} unfinished: ` +
            `${Math.round(d)} ms until the error</title></rect>`;
        } else if (d > 0) {
          s += `<rect class="bar" data-phase="${name}" data-ms="${d}" x="${x(at)}" y="${by}" ` +
            `width="${Math.max(1, x(at + d) - x(at))}" height="${bh}" fill="${phaseColor(name, k)}">` +
            `<title>${esc(name)}: ${d} ms (from ${Math.round(at)} to ${Math.round(at + d)} ms)</title></rect>`;
        }
        at += d;
      }
      for (const name of D.marks) {
        const t = mk(i, name);
        if (t == null || (name === "end" && D.errors[i]) || name === "longest_gap") continue;
        const big = name === "first_token";
        s += `<line class="tick ${name}" data-ms="${t}" x1="${x(t)}" x2="${x(t)}" y1="${big ? y + 1 : by}" ` +
          `y2="${big ? y + RH - 1 : by + bh}"><title>${esc(name)} at ${t} ms</title></line>`;
      }
      // The longest gap where it happened: before the first token (prefill) or after it (a stall).
      const gap = C.gap[i], first = mk(i, "first_token"), began = mk(i, "longest_gap");
      if (gap && gap > 1 && (began != null || first != null)) {
        const from = began ?? first, gx = x(from), gw = Math.max(2, x(from + gap) - gx), gy = by + bh + 2;
        const where = began == null ? "its place in the stream is not recorded" :
          first != null && began < first ? "before the first token" : "after the first token";
        s += `<path class="gap" data-from="${from}" data-ms="${gap}" data-where="${where}" d="M${gx} ${gy - 2}v2h${gw}v-2">` +
          `<title>longest gap between chunks: ${gap} ms from ${Math.round(from)} ms, ${where}</title></path>`;
      }
      if (D.errors[i] != null) {
        const end = mk(i, "end"), name = (D.error_phases || {})[i];
        // Records written before the failed phase ran on to the error: what the failure cost, drawn after.
        if (end != null && end > at + 0.5 && name) {
          s += `<rect class="bar unfinished" data-phase="${name}" data-ms="${+(end - at).toFixed(1)}" x="${x(at)}" y="${by}" ` +
            `width="${Math.max(1, x(end) - x(at))}" height="${bh}" fill="${phaseColor(name, D.phases.indexOf(name))}" ` +
            `fill-opacity="0.3" stroke="#c0392b" stroke-dasharray="4 2"><title>${esc(name)} unfinished: ` +
            `${Math.round(end - at)} ms until the error</title></rect>`;
        }
        const ex = x(end ?? at), ey = y + RH / 2;
        s += `<path class="err" d="M${ex - 4} ${ey - 4}l8 8m0 -8l-8 8"><title>${esc(D.errors[i])}</title></path>`;
      }
      s += `<text class="verdict" x="${W - RW + 8}" y="${y + 16}" fill="${verdictColor(C.v[i])}">` +
        `${esc(D.verdicts[C.v[i]]).slice(0, 40)}</text></g>`;
    });
    s += `</svg>`;
    const box = el("div", { class: "wf" }, s);
    box.querySelectorAll(".wf-row").forEach((g) => g.addEventListener("click", () => pick(+g.dataset.index)));
    return box;
  }
  const used = D.phases.filter((name, k) => { for (let i = 0; i < N; i++) if (ph(i, k)) return true; return false; });
  function phaseLegend(names = used) {
    return legend(names.map((name) => [phaseColor(name, D.phases.indexOf(name)), name]).concat(
      [["#c0392b", names === used ? "first token (red line)" : "ttft (red line)"]]));
  }

  let picked = null;
  function pick(i, scroll = true) {
    if (!picked) return;
    picked.innerHTML = "";
    picked.appendChild(el("h2", {}, `Request ${esc(C.id[i])}`));
    const when = new Date((D.t0 + C.t[i]) * 1000).toISOString().replace("T", " ").slice(0, 23);
    const err = D.errors[i] != null ? `\nerror: ${D.errors[i]}` : "";
    const marks = D.marks.map((m) => `${m} ${mk(i, m) ?? "–"}`).join(" · ");
    picked.appendChild(el("p", { class: "detail" }, esc(
      `${when} UTC · ${label(i)} · status ${C.status[i] ?? "–"} · ttft ${fmtMs(C.ttft[i])} · ` +
      `prompt tokens ${C.pt[i] ?? "–"} · longest gap ${fmtMs(C.gap[i])}\nverdict: ${D.verdicts[C.v[i]]}${err}\n` +
      `marks (ms): ${marks}`)));
    picked.appendChild(waterfall([i], {}));
    picked.dataset.index = i;
    document.querySelectorAll(".picked").forEach((e) => e.classList.remove("picked"));
    document.querySelectorAll(`[data-index="${i}"]`).forEach((e) => e.classList.add("picked"));
    if (scroll) picked.scrollIntoView({ block: "nearest" });
  }

  // --- scatter plots (canvas) -----------------------------------------------------------
  function canvas(w, h) {
    const c = el("canvas"), r = window.devicePixelRatio || 1;
    c.width = w * r; c.height = h * r; c.style.width = w + "px"; c.style.height = h + "px";
    const g = c.getContext("2d");
    g.scale(r, r);
    g.font = '11px "DejaVu Sans", Arial, sans-serif';
    return [c, g];
  }
  function axes(g, xs, ys, box, fx, fy) {
    const [L, T, R, B] = box;
    g.strokeStyle = "#e6e9ee"; g.fillStyle = "#5b6576"; g.lineWidth = 1;
    g.textAlign = "center";
    for (const v of xs.ticks) { const px = xs.map(v); g.beginPath(); g.moveTo(px, T); g.lineTo(px, B); g.stroke(); g.fillText(fx(v), px, B + 14); }
    g.textAlign = "right";
    for (const v of ys.ticks) { const py = ys.map(v); g.beginPath(); g.moveTo(L, py); g.lineTo(R, py); g.stroke(); g.fillText(fy(v), L - 5, py + 4); }
  }
  function linear(lo, hi, a, b, n) {
    const axis = niceAxis(lo, hi, n), span = axis.hi - lo || 1;
    return { map: (v) => a + (v - lo) / span * (b - a), ticks: axis.ticks, lo, hi: axis.hi };
  }
  function logScale(lo, hi, a, b) {
    // From lo up to the first 1·10ⁿ or 3·10ⁿ at or above hi: the slowest dot is below the top tick, not on the edge.
    const steps = [];
    for (let e = Math.floor(Math.log10(Math.max(1, lo))); steps.length < 2 || steps[steps.length - 1] < hi; e++)
      for (const f of [1, 3]) steps.push(f * Math.pow(10, e));
    const top = Math.max(steps.find((v) => v >= hi), lo * 10, 10);
    const l0 = Math.log10(Math.max(1, lo)), l1 = Math.log10(top);
    const ticks = steps.filter((v) => v >= Math.pow(10, l0) * 0.99 && v <= top * 1.01);
    return { map: (v) => a + (Math.log10(Math.max(1, v)) - l0) / (l1 - l0) * (b - a), ticks, hi: top };
  }
  function clickNearest(c, points, onPick) {
    c.addEventListener("click", (ev) => {
      const rect = c.getBoundingClientRect(), mx = ev.clientX - rect.left, my = ev.clientY - rect.top;
      let best = -1, bestD = 64;
      for (let j = 0; j < points.i.length; j++) {
        const d = (points.x[j] - mx) ** 2 + (points.y[j] - my) ** 2;
        if (d < bestD) { bestD = d; best = points.i[j]; }
      }
      if (best >= 0) onPick(best);
    });
  }
  let tSpan = 0;
  for (let i = 0; i < N; i++) tSpan = Math.max(tSpan, C.t[i]);
  const timeLabel = (sec) => {
    const iso = new Date((D.t0 + sec) * 1000).toISOString();
    return tSpan > 86400 ? iso.slice(5, 10) + " " + iso.slice(11, 16) : tSpan < 600 ? iso.slice(11, 19) : iso.slice(11, 16);
  };

  function timeTicks(spanS, count) {
    // On the wall clock's round minutes and hours (UTC), not at round offsets from the first record.
    const step = [1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400].find((st) => spanS / st <= count) || 86400 * 7;
    const out = [];
    for (let t = Math.ceil(D.t0 / step) * step - D.t0; t <= spanS; t += step) out.push(t);
    return out;
  }
  function ttftOverTime(s) {
    const W = 1180, H = 300, box = [60, 10, W - 10, H - 24];
    const [c, g] = canvas(W, H);
    const rows = [];
    let tmax = 0, ymin = Infinity, ymax = 0;
    for (let i = 0; i < N; i++) {
      if (C.kind[i] === "prewarm") continue;
      const y = C.ttft[i] ?? mk(i, "end");
      if (y == null) continue;
      rows.push(i); tmax = Math.max(tmax, C.t[i]); ymin = Math.min(ymin, y); ymax = Math.max(ymax, y);
    }
    if (!rows.length) { s.appendChild(el("p", { class: "note" }, "No request with a first token or an end.")); return; }
    const size = D.buckets.size_s;
    const xs = linear(0, Math.max(tmax, size), box[0], box[2], 10);
    xs.ticks = timeTicks(xs.hi, 10);
    const ys = logScale(ymin, ymax, box[3], box[1]);
    axes(g, xs, ys, box, timeLabel, fmtMs);
    c.dataset.yTicks = JSON.stringify(ys.ticks);
    c.dataset.yMax = ymax;
    const pts = { i: [], x: [], y: [] };
    const order = rows.slice().sort((a, b) => C.v[a] - C.v[b]).reverse(); // rare verdicts drawn last, on top
    // Many dots: small and faint for the commonest verdict, so density shows and the rare ones stand out.
    const dot = rows.length > 20000 ? 2 : 3, faint = rows.length > 50000 ? 0.2 : rows.length > 5000 ? 0.4 : 0.8;
    for (const i of order) {
      const px = xs.map(C.t[i]), py = ys.map(C.ttft[i] ?? mk(i, "end"));
      g.fillStyle = verdictColor(C.v[i]);
      g.globalAlpha = C.v[i] === 0 ? faint : 0.9;
      if (C.ttft[i] == null) { g.fillRect(px - 2.5, py - 2.5, 5, 5); } else { g.fillRect(px - dot / 2, py - dot / 2, dot, dot); }
      pts.i.push(i); pts.x.push(px); pts.y.push(py);
    }
    g.globalAlpha = 1;
    clickNearest(c, pts, pick);
    c.dataset.points = rows.length;
    c.id = "ttft-over-time";
    const counts = D.verdicts.map(() => 0);
    for (const i of rows) counts[C.v[i]]++;
    s.appendChild(legend(D.verdicts.map((v, k) => [verdictColor(k), `${v} (${counts[k]})`])));
    s.appendChild(c);
    // Phase medians per bucket, on the same time axis.
    const B = D.buckets, BH = 170, bb = [60, 8, W - 10, BH - 20];
    let maxSum = 1;
    for (const row of B.medians) maxSum = Math.max(maxSum, row.reduce((a, b) => a + b, 0));
    const yb = linear(0, maxSum, bb[3], bb[1], 4);
    let svg = `<svg class="buckets" width="${W}" height="${BH}"><g class="axis">`;
    for (const v of yb.ticks) svg += `<line class="grid" x1="${bb[0]}" x2="${bb[2]}" y1="${yb.map(v)}" y2="${yb.map(v)}"/>` +
      `<text x="${bb[0] - 5}" y="${yb.map(v) + 4}" text-anchor="end">${fmtMs(v)}</text>`;
    for (const v of xs.ticks) svg += `<text x="${xs.map(v)}" y="${BH - 4}" text-anchor="middle">${timeLabel(v)}</text>`;
    svg += `</g>`;
    B.start.forEach((t, b) => {
      const x0 = xs.map(t), bw = Math.max(2, xs.map(t + size) - x0 - 1);
      let acc = 0;
      svg += `<g class="bucket" data-start="${t}" data-n="${B.n[b]}">`;
      B.medians[b].forEach((v, k) => {
        if (!v) return;
        svg += `<rect x="${x0}" y="${yb.map(acc + v)}" width="${bw}" height="${yb.map(acc) - yb.map(acc + v)}" ` +
          `fill="${phaseColor(D.phases[k], k)}"><title>${timeLabel(t)}: median ${D.phases[k]} ${v} ms (${B.n[b]} requests)</title></rect>`;
        acc += v;
      });
      svg += `</g>`;
    });
    s.appendChild(el("p", { class: "note" }, `Median of each phase per ${size >= 3600 ? size / 3600 + " h" : size / 60 + " min"} (stacked; medians of parts do not add up to the median ttft):`));
    s.appendChild(el("div", {}, svg + "</svg>"));
    s.appendChild(phaseLegend(D.phases.slice(0, B.medians.length ? B.medians[0].length : 0)));
  }

  function waitVsPrompt(s) {
    const W = 1180, H = 320, box = [60, 10, W - 10, H - 24];
    const rows = [];
    const xs_all = [], ys_all = [];
    for (let i = 0; i < N; i++) if (C.up[i] != null && C.own[i] != null && D.errors[i] == null && C.kind[i] !== "prewarm") {
      rows.push(i); xs_all.push(C.up[i]); ys_all.push(C.own[i]);
    }
    if (!rows.length) { s.appendChild(el("p", { class: "note" }, "No request with both a prompt size and an upstream wait.")); return; }
    // The axes end a little past the 99.5th percentile: a few outliers would squeeze everything else.
    const cap = (v) => { v.sort((a, b) => a - b); return v[Math.floor(0.995 * (v.length - 1))] * 1.15 || 1; };
    const xmax = cap(xs_all), ycap = cap(ys_all);
    const [c, g] = canvas(W, H);
    const xs = linear(0, xmax, box[0], box[2], 10), ys = linear(0, ycap, box[3], box[1], 6);
    axes(g, xs, ys, box, (v) => v >= 1000 ? v / 1000 + "k" : v, fmtMs);
    g.globalAlpha = rows.length > 50000 ? 0.25 : rows.length > 5000 ? 0.4 : 0.75;
    const dot = rows.length > 20000 ? 2 : 3, pts = { i: [], x: [], y: [] };
    let beyond = 0;
    for (const i of rows) {
      if (C.up[i] > xmax || C.own[i] > ycap) { beyond++; continue; }
      const px = xs.map(C.up[i]), py = ys.map(C.own[i]);
      g.fillStyle = groupColor(C.g[i]); g.fillRect(px - dot / 2, py - dot / 2, dot, dot);
      pts.i.push(i); pts.x.push(px); pts.y.push(py);
    }
    g.globalAlpha = 1; g.lineWidth = 2;
    g.save(); g.beginPath(); g.rect(box[0], box[1], box[2] - box[0], box[3] - box[1]); g.clip();
    const items = [];
    Object.entries(D.fits).forEach(([group, f]) => {
      const gi = D.groups.indexOf(group), color = groupColor(gi);
      const rate = f.ms_per_1k_uncached || 0;
      g.strokeStyle = color; g.beginPath();
      g.moveTo(xs.map(0), ys.map(f.base_ms)); g.lineTo(xs.map(xs.hi), ys.map(f.base_ms + rate * xs.hi / 1000));
      g.stroke();
      items.push([color, `${group}: ${Math.round(f.base_ms)} ms + ${rate.toFixed(1)} ms per 1k uncached tokens ` +
        `(median fit of ${f.n} requests, spread ${Math.round(f.spread_ms)} ms)`]);
    });
    g.restore();
    clickNearest(c, pts, pick);
    c.id = "wait-vs-prompt";
    s.appendChild(legend(items));
    s.appendChild(c);
    s.appendChild(el("p", { class: "note" }, "x: uncached prompt tokens · y: the upstream's own wait (upstream wait + head to first token, one round trip taken out); the line: the first token the relay learns to expect, without cached tokens" +
      (beyond ? ` · ${beyond} requests beyond the axes (past the 99.5th percentile) not drawn, but fitted` : "")));
  }

  function percentileBars(s) {
    const W = 1180, LW = 300, BH = 16, crit = D.phases.filter((p) => p !== "stream");
    const groups = Object.keys(D.percentiles);
    let most = 1;
    for (const gname of groups) for (const q of ["p50", "p90", "p99"]) {
      const st = D.percentiles[gname];
      most = Math.max(most, crit.reduce((a, p) => a + (st[p] ? st[p][q] : 0), 0), st.ttft ? st.ttft[q] : 0);
    }
    const axis = niceAxis(0, most, 8), max = axis.hi;
    const x = (v) => LW + v / max * (W - LW - 20);
    const H = 20 + groups.length * (3 * BH + 16);
    let svg = `<svg class="percentiles" width="${W}" height="${H}"><g class="axis">`;
    for (const t of axis.ticks) svg += `<line class="grid" x1="${x(t)}" x2="${x(t)}" y1="14" y2="${H}"/><text x="${x(t)}" y="10" text-anchor="middle">${fmtMs(t)}</text>`;
    svg += `</g>`;
    let y = 18;
    for (const gname of groups) {
      const st = D.percentiles[gname], n = D.counts[gname] || {};
      svg += `<text x="4" y="${y + BH + 4}" class="verdict">${esc(gname).slice(0, 40)}</text>`;
      svg += `<text x="4" y="${y + 2 * BH + 6}">${n.requests ?? ""} requests, ${n.errors ?? 0} errors</text>`;
      for (const q of ["p50", "p90", "p99"]) {
        let acc = 0;
        svg += `<g class="pbar" data-group="${esc(gname)}" data-q="${q}"><text x="${LW - 6}" y="${y + BH - 4}" text-anchor="end">${q}</text>`;
        crit.forEach((p) => {
          const v = st[p] ? st[p][q] : 0;
          if (!v) return;
          const k = D.phases.indexOf(p);
          svg += `<rect data-phase="${p}" x="${x(acc)}" y="${y + 1}" width="${Math.max(1, x(acc + v) - x(acc))}" height="${BH - 2}" fill="${phaseColor(p, k)}"><title>${esc(gname)} ${q} ${p}: ${v} ms</title></rect>`;
          acc += v;
        });
        if (st.ttft) svg += `<line class="tick first_token" x1="${x(st.ttft[q])}" x2="${x(st.ttft[q])}" y1="${y}" y2="${y + BH}"><title>ttft ${q}: ${st.ttft[q]} ms</title></line>`;
        svg += `</g>`;
        y += BH;
      }
      y += 16;
    }
    s.appendChild(el("div", {}, svg + "</svg>"));
    s.appendChild(phaseLegend(crit));
    s.appendChild(el("p", { class: "note" }, "Each bar stacks the phases' own percentile; the red line is the percentile of ttft itself."));
  }

  // --- upstream groups: a table per group, a row per member ------------------------------
  function upstreamGroups(s) {
    const count = (o) => Object.entries(o).map(([k, n]) => `${esc(k)} ${n}`).join(", ") || "–";
    for (const [name, g] of Object.entries(D.upstream_groups)) {
      s.appendChild(el("h3", {}, `${esc(name)}: ${g.requests} requests, ${g.failed_over} failed over before the head, ` +
        `${g.hedged || 0} hedged, ${g.waited || 0} late heads waited for, ` +
        `${g.duplicated_prompt_tokens} prompt tokens sent again`));
      const rows = Object.entries(g.members).map(([member, m]) => {
        const q = (k) => `<td class="num">${m.ttft ? fmtMs(m.ttft[k]) : "–"}</td>`;
        return `<tr><td>${esc(member)}</td><td class="num">${m.chosen}</td><td class="num">${m.served}</td>` +
          q("p50") + q("p90") + q("p99") + `<td class="num">${m.ttft ? m.ttft.n : 0}</td>` +
          `<td>${count(m.reasons)}</td><td>${count(m.failovers)}</td><td>${count(m.hedges || {})}</td>` +
          `<td>${count(m.waited || {})}</td>` +
          `<td class="num">${m.duplicated_prompt_tokens}</td></tr>`;
      }).join("");
      s.appendChild(el("table", { class: "members" }, "<thead><tr><th>member</th><th class=\"num\">chosen</th>" +
        "<th class=\"num\">served</th><th class=\"num\">ttft p50</th><th class=\"num\">p90</th><th class=\"num\">p99</th>" +
        "<th class=\"num\">n</th><th>chosen why</th><th>failed over (cause)</th><th>hedged (whose head first)</th>" +
        "<th>late head waited for (instead of)</th>" +
        "<th class=\"num\">prompt tokens sent again</th>" +
        `</tr></thead><tbody>${rows}</tbody>`));
    }
  }

  // --- the request table ---------------------------------------------------------------
  function requestTable(s) {
    const PAGE = 50;
    let order = [...Array(N).keys()], sortKey = "ttft", page = 0, filtered = order;
    const controls = el("div", { class: "controls" });
    const input = el("input", { type: "search", placeholder: "filter: id, verdict, upstream · model, status" });
    const prev = el("button", {}, "‹ prev"), next = el("button", {}, "next ›"), info = el("span", { class: "note" });
    controls.append(input, prev, next, info);
    const table = el("table", { id: "requests" });
    const cols = [["t", "time (UTC)"], ["ttft", "ttft", "num"], ["v", "verdict"], ["g", "upstream · model"],
      ["status", "status", "num"], ["pt", "prompt tokens", "num"], ["id", "id"]];
    table.appendChild(el("thead", {}, "<tr>" + cols.map(([k, name, cls]) => `<th data-key="${k}" class="${cls || ""}">${name}</th>`).join("") + "</tr>"));
    const body = el("tbody");
    table.appendChild(body);
    const sortBy = (key) => {
      sortKey = key;
      const v = C[key], desc = key === "ttft" || key === "pt";
      order.sort((a, b) => {
        const x = v[a], y = v[b];
        if (x == null) return 1; if (y == null) return -1;
        return (x < y ? -1 : x > y ? 1 : 0) * (desc ? -1 : 1);
      });
    };
    const apply = () => {
      const q = input.value.trim().toLowerCase();
      filtered = q ? order.filter((i) => (C.id[i] + " " + D.verdicts[C.v[i]] + " " + D.groups[C.g[i]] + " " + C.status[i] + " " + C.kind[i]).toLowerCase().includes(q)) : order;
      page = Math.min(page, Math.max(0, Math.ceil(filtered.length / PAGE) - 1));
      render();
    };
    const render = () => {
      const rows = filtered.slice(page * PAGE, page * PAGE + PAGE);
      body.innerHTML = rows.map((i) => `<tr data-index="${i}"><td>${new Date((D.t0 + C.t[i]) * 1000).toISOString().slice(0, 19).replace("T", " ")}</td>` +
        `<td class="num">${fmtMs(C.ttft[i])}</td><td style="color:${verdictColor(C.v[i])}">${esc(D.verdicts[C.v[i]])}</td>` +
        `<td>${esc(D.groups[C.g[i]])}${C.kind[i] ? " [" + C.kind[i] + "]" : ""}</td><td class="num">${C.status[i] ?? "–"}</td>` +
        `<td class="num">${C.pt[i] ?? "–"}</td><td class="id">${esc(C.id[i])}</td></tr>`).join("");
      info.textContent = `${filtered.length ? page * PAGE + 1 : 0}–${Math.min(filtered.length, page * PAGE + PAGE)} of ${filtered.length} (sorted by ${sortKey})`;
    };
    body.addEventListener("click", (ev) => { const tr = ev.target.closest("tr"); if (tr) pick(+tr.dataset.index); });
    table.querySelector("thead").addEventListener("click", (ev) => { const th = ev.target.closest("th"); if (th) { sortBy(th.dataset.key); apply(); } });
    input.addEventListener("input", () => { page = 0; apply(); });
    prev.addEventListener("click", () => { page = Math.max(0, page - 1); render(); });
    next.addEventListener("click", () => { if ((page + 1) * PAGE < filtered.length) page++; render(); });
    sortBy("ttft"); apply();
    s.append(controls, table);
  }

  // --- the page ----------------------------------------------------------------------------
  app.innerHTML = `<h1>${esc(D.title)}</h1>`;
  if (D.kind === "diagnose") {
    const s = section("Verdict");
    s.appendChild(el("p", { class: "verdict-line" }, esc(D.verdict || "nothing stands out")));
    if (D.advice) s.appendChild(el("p", {}, esc(D.advice)));
    s.appendChild(el("ul", { class: "findings" }, D.findings.map((f) =>
      `<li class="${f.significant ? "sig" : ""}">${esc(f.cause)}: ${f.fatal || f.weighed === false ? "" : esc(fmtMs(f.ms)) + " — "}${esc(f.detail)}</li>`).join("")));
    const w = section("Probe waterfalls", "Each probe on one time axis from the moment it began: DNS, TCP, proxy tunnel, TLS, request sent (on a WebSocket: the upgrade), wait for the head (the 101), the turn's message, head to first token, then the stream. A row “↳ the relay's record of it” is the relay's own record of the probe above, placed where the probe sent its request.");
    w.appendChild(waterfall([...Array(N).keys()], {}));
    w.appendChild(phaseLegend());
  } else {
    app.appendChild(el("p", { class: "note" }, `${N} records · generated ${esc(D.generated)} · first ${new Date(D.t0 * 1000).toISOString().slice(0, 19)} UTC`));
    const slow = section(`Slowest ${D.slowest.length} first tokens`, "One row per request on a shared time axis from the request head (0): a bar per phase on the critical path to the first token (red line), then the stream. Dashed: the longest gap between chunks, where it happened (before the first token: prefill; after it: a stall). Click a row, a dot or a table row to see that request alone below.");
    slow.appendChild(waterfall(D.slowest, { rank: true }));
    slow.appendChild(phaseLegend());
    picked = section("Picked request", "Click a row, a dot or a table row.");
    ttftOverTime(section("First token over time", "Each request a dot (log scale), coloured by verdict; squares: failed requests, at the time they failed."));
    waitVsPrompt(section("Upstream wait vs prompt tokens", "A steep line (many ms per 1k tokens) means context length drives the wait; a high base means queueing or a slow model; dots far above the line: upstream queueing."));
    percentileBars(section("Phase percentiles per upstream · model"));
    if (D.upstream_groups && Object.keys(D.upstream_groups).length)
      upstreamGroups(section("Upstream groups", "Per member: the requests sent to it first and why (order: nothing learned yet; exploring: its first-token line was being learned; lowest: the lowest expected first token; sticky: the conversation's cache is there; left_cache: another was quicker by more than the cache miss), those it served, its own first tokens (successful answers with no failover or winning hedge before them), the failovers from it, each sending the prompt again, and the hedges of its late heads (sent to the next member as well; first: its own head came first, second: the hedge's), each paying the prompt twice, and its late heads waited for because no other member was expected to give the first token sooner than its remaining wait (instead of a hedge, or of giving it up at its slow head)."));
    requestTable(section("Requests", "Click a column to sort, a row to see its waterfall."));
  }
  const want = decodeURIComponent(location.hash.slice(1));
  const at = want ? C.id.indexOf(want) : -1;
  if (at >= 0) pick(at, false); else if (D.slowest && D.slowest.length) pick(D.slowest[0], false);
  document.body.dataset.renderMs = Math.round(performance.now() - t_start);
  document.body.dataset.rendered = "1";
})();
