// cachet's live prefix-cache dashboard (GET /dashboard).
//
// Data: `GET /v1/cache/stats/stream` (server-sent events, one `snapshot` a second: monotonic
// totals, gauges, miss reasons, what-if, divergence, tenants, the last requests), polled
// `GET /v1/cache` (pool and hottest prefixes), on a click `GET /v1/cache/requests/{id}`, and
// the KV cache events of `GET /v1/cache/events` (live from when the page opened).
// Rates are computed here from successive snapshots (delta / delta-t); a counter that went down
// (server restarted, cache reset) gives a gap, never a negative rate.
//
// API key: taken from the URL fragment (`/dashboard#key=...`, which browsers never send to a
// server) or from the form the page shows on a 401, kept in this tab's sessionStorage, and sent
// as an `Authorization: Bearer` header. The stream is therefore read with fetch() and parsed
// here rather than with EventSource (which cannot send headers and would need the key in the
// URL, where access logs and proxies keep it). The fragment is removed from the address bar
// as soon as it is read.
//
// Every server string is put in the page with textContent (request ids are caller-chosen).
(function () {
  "use strict";

  const MAX_POINTS = 300; // five minutes at one snapshot a second
  const HOTTEST_EVERY_MS = 5000;
  const KEY_STORE = "cachet.dashboard.key";
  const MISS_ORDER = ["never_cached", "evicted", "partial_block", "capped_for_logits",
    "lookup_skipped", "load_failed"];
  const MISS_TEXT = {
    never_cached: "never cached",
    evicted: "evicted earlier",
    partial_block: "partial last block",
    capped_for_logits: "kept for logits (N−1)",
    lookup_skipped: "lookup skipped",
    load_failed: "external load failed",
  };

  // ---------- small helpers ----------
  const $ = (id) => document.getElementById(id);
  const nf0 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  const nf1 = new Intl.NumberFormat("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
  const num = (v) => (typeof v === "number" && isFinite(v) ? v : 0);
  const fmtInt = (v) => (typeof v === "number" && isFinite(v) ? nf0.format(v) : "–");
  const fmtRate = (v) => (v == null || !isFinite(v) ? "–" : v < 100 ? nf1.format(v) : nf0.format(v));
  const nfTick = new Intl.NumberFormat("en-US", { maximumFractionDigits: 2 });
  const fmtTick = (v) => (v == null ? "" : Math.abs(v) >= 1000 ? nf0.format(v) : nfTick.format(v));
  const fmtPct = (v) => (v == null || !isFinite(v) ? "–" : nf1.format(v) + " %");
  const ratio = (a, b) => (b > 0 ? (100 * a) / b : null);
  const fmtSecs = (s) => {
    if (typeof s !== "number" || !isFinite(s)) return "–";
    if (s < 60) return nf0.format(s) + " s";
    if (s < 3600) return nf0.format(s / 60) + " min";
    return nf1.format(s / 3600) + " h";
  };

  function h(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v == null) continue;
        if (k === "class") e.className = v;
        else if (k === "style") Object.assign(e.style, v);
        else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
        else e.setAttribute(k, v);
      }
    }
    for (const k of kids) {
      if (k == null) continue;
      e.append(k instanceof Node ? k : String(k));
    }
    return e;
  }

  function replaceKids(node, kids) {
    node.replaceChildren(...kids);
  }

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  // ---------- the API key ----------
  let apiKey = null;
  function loadKey() {
    const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
    if (m) {
      try { apiKey = decodeURIComponent(m[1]); } catch (_) { apiKey = m[1]; }
      history.replaceState(null, "", location.pathname + location.search);
      try { sessionStorage.setItem(KEY_STORE, apiKey); } catch (_) { /* storage off: memory only */ }
      return;
    }
    try { apiKey = sessionStorage.getItem(KEY_STORE); } catch (_) { apiKey = null; }
  }
  function authHeaders(extra) {
    const hd = Object.assign({}, extra || {});
    if (apiKey) hd.Authorization = "Bearer " + apiKey;
    return hd;
  }
  // 401: no key or a wrong one; 403: a tenant's (named) key, which the server refuses on the
  // routes that show every tenant's cache: the page needs an operator key.
  class Unauthorized extends Error {
    constructor(status) { super("HTTP " + status); this.status = status; }
  }
  function keyProblem(e) {
    if (e.status === 403) return "a tenant's key: this page needs an operator key";
    return apiKey ? "wrong API key" : "API key needed";
  }
  function askForKey() {
    const f = $("keyform");
    f.hidden = false;
    $("keyinput").focus();
  }
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("keyinput").value.trim() || null;
    $("keyinput").value = "";
    try { if (apiKey) sessionStorage.setItem(KEY_STORE, apiKey); } catch (_) { /* memory only */ }
    $("keyform").hidden = true;
    restartStream();
    runEvents();
    refreshHottest();
  });

  async function getJson(path) {
    const r = await fetch(path, { headers: authHeaders({ Accept: "application/json" }), cache: "no-store" });
    if (r.status === 401 || r.status === 403) throw new Unauthorized(r.status);
    if (!r.ok) {
      const e = new Error("HTTP " + r.status);
      e.status = r.status;
      throw e;
    }
    return r.json();
  }

  // ---------- connection status ----------
  function setConn(kind, text) {
    const c = $("conn");
    c.className = "conn " + kind;
    c.textContent = text;
  }

  // ---------- charts ----------
  const charts = {};
  // Per chart: x (unix seconds) and one array per series; `raw` keeps unstacked values.
  const series = {
    hit: [[], [], []],
    src: [[], [], [], []],
    kv: [[], [], [], []],
    kvRaw: [[], [], [], []],
    evict: [[], []],
  };

  function axisOpts(fmt) {
    const fg = cssVar("--muted");
    const grid = cssVar("--grid");
    return [
      { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } },
      { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, size: 56,
        values: (u, vals) => vals.map(fmt) },
    ];
  }

  function makeChart(key, elId, seriesOpts, yRange, fmt) {
    const el = $(elId);
    const opts = {
      width: Math.max(280, el.clientWidth),
      height: 200,
      scales: { x: { time: true }, y: { range: yRange } },
      series: [{}].concat(seriesOpts),
      axes: axisOpts(fmt),
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
    };
    const u = new uPlot(opts, series[key], el);
    charts[key] = u;
    if (typeof ResizeObserver === "function") {
      new ResizeObserver(() => {
        const w = Math.max(280, el.clientWidth);
        if (Math.abs(w - u.width) > 1) u.setSize({ width: w, height: 200 });
      }).observe(el);
    }
    return u;
  }

  const rangeFromZero = (u, min, max) => [0, max > 0 ? max * 1.1 : 1];

  function initCharts() {
    const c = (n) => cssVar("--c" + n);
    const pctVal = (u, v) => fmtPct(v);
    const rateVal = (u, v) => fmtRate(v);
    makeChart("hit", "c-hit", [
      { label: "local", stroke: c(1), width: 2, value: pctVal },
      { label: "external", stroke: c(2), width: 2, dash: [6, 3], value: pctVal },
    ], [0, 100], (v) => v + " %");
    makeChart("src", "c-src", [
      { label: "local cache hit", stroke: c(1), width: 2, value: rateVal },
      { label: "computed", stroke: c(2), width: 2, value: rateVal },
      { label: "external transfer", stroke: c(5), width: 2, dash: [6, 3], value: rateVal },
    ], rangeFromZero, fmtTick);
    // Stacked by painting: the tallest (cumulative) layer first, each later one over it.
    const kvVal = (u, v, si, i) => (i == null ? "–" : fmtInt(series.kvRaw[si][i]));
    makeChart("kv", "c-kv", [
      { label: "free", stroke: c(7), fill: cssVar("--grid"), width: 1, value: kvVal },
      { label: "cached idle", stroke: c(3), fill: c(3), width: 1, value: kvVal },
      { label: "in use", stroke: c(1), fill: c(1), width: 1, value: kvVal },
    ], rangeFromZero, fmtTick);
    makeChart("evict", "c-evict", [
      { label: "evictions/s", stroke: c(4), width: 2, value: rateVal },
    ], rangeFromZero, fmtTick);
  }

  function pushPoint(key, x, ys) {
    const d = series[key];
    d[0].push(x);
    ys.forEach((y, i) => d[i + 1].push(y));
    if (d[0].length > MAX_POINTS) d.forEach((a) => a.shift());
  }

  function numsList(dl, pairs) {
    replaceKids(dl, pairs.map(([k, v]) => h("div", null, h("dt", null, k), h("dd", null, v))));
  }

  // ---------- snapshots ----------
  let prev = null;
  let snapshots = 0;
  const RATE_COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
    "external_prefix_cache_hits", "prompt_tokens_local_compute", "prompt_tokens_local_cache_hit",
    "prompt_tokens_external_kv_transfer", "blocks_evicted"];

  function onSnapshot(s) {
    snapshots += 1;
    const c = s.counters || {};
    const g = s.gauges || {};
    const x = num(s.ts);
    let d = null; // per-counter deltas over dt, when this interval is usable
    let dt = 0;
    if (prev) {
      dt = x - num(prev.ts);
      const pc = prev.counters || {};
      const reset = RATE_COUNTERS.some((k) => num(c[k]) < num(pc[k]));
      if (dt > 0 && !reset) {
        d = {};
        for (const k of RATE_COUNTERS) d[k] = num(c[k]) - num(pc[k]);
      }
    }
    if (prev && x <= num(prev.ts)) {
      // Same or older timestamp: totals still update, no new chart point.
    } else {
      const hitLocal = d ? ratio(d.prefix_cache_hits, d.prefix_cache_queries) : null;
      const hitExt = d ? ratio(d.external_prefix_cache_hits, d.external_prefix_cache_queries) : null;
      pushPoint("hit", x, [hitLocal, hitExt]);
      pushPoint("src", x, d ? [d.prompt_tokens_local_cache_hit / dt, d.prompt_tokens_local_compute / dt,
        d.prompt_tokens_external_kv_transfer / dt] : [null, null, null]);
      const inUse = num(g.blocks_in_use);
      const idle = num(g.blocks_cached_idle);
      const free = num(g.blocks_free);
      pushPoint("kv", x, [inUse + idle + free, inUse + idle, inUse]);
      pushPoint("kvRaw", x, [free, idle, inUse]);
      pushPoint("evict", x, [d ? d.blocks_evicted / dt : null]);
      for (const k of ["hit", "src", "kv", "evict"]) charts[k].setData(series[k]);
    }
    prev = s;
    renderNumbers(s, d, dt);
    renderMiss(s.miss_tokens || {});
    renderWhatif(s.whatif || {});
    renderDiverged(s.diverged || {}, s.recent || []);
    renderTenants(s.tenants || []);
    renderRecent(s.recent || []);
    $("updated").textContent = "updated " + new Date(x * 1000).toLocaleTimeString("en-GB");
  }

  function last(a) {
    for (let i = a.length - 1; i >= 0; i--) if (a[i] != null) return a[i];
    return null;
  }

  function renderNumbers(s, d, dt) {
    const c = s.counters || {};
    const g = s.gauges || {};
    const hitTot = ratio(num(c.prefix_cache_hits), num(c.prefix_cache_queries));
    const extTot = ratio(num(c.external_prefix_cache_hits), num(c.external_prefix_cache_queries));
    $("t-hit").textContent = fmtPct(hitTot);
    $("t-ext").textContent = fmtPct(extTot);
    $("t-prompt").textContent = fmtInt(c.prompt_tokens);
    const kvPerc = typeof g.kv_cache_usage_perc === "number" ? 100 * g.kv_cache_usage_perc : null;
    $("t-kv").textContent = fmtPct(kvPerc);
    $("t-req").textContent = fmtInt(g.num_requests_running) + " / " + fmtInt(g.num_requests_waiting);
    const ev = d ? d.blocks_evicted / dt : null;
    $("t-evict").textContent = fmtRate(ev);

    const hl = last(series.hit[1]);
    const he = last(series.hit[2]);
    numsList($("n-hit"), [["local, latest", fmtPct(hl)], ["external, latest", fmtPct(he)],
      ["local total", fmtPct(hitTot)], ["external total", fmtPct(extTot)]]);
    $("c-hit").setAttribute("aria-label", "Hit rate over time. Latest: local " + fmtPct(hl) +
      ", external " + fmtPct(he) + ".");

    const src = [["local cache hit", c.prompt_tokens_local_cache_hit, series.src[1]],
      ["computed", c.prompt_tokens_local_compute, series.src[2]],
      ["external transfer", c.prompt_tokens_external_kv_transfer, series.src[3]]];
    numsList($("n-src"), src.map(([k, tot, arr]) => [k, fmtRate(last(arr)) + "/s · " + fmtInt(tot) + " total"]));
    $("c-src").setAttribute("aria-label", "Prompt tokens by source, totals: " +
      src.map(([k, tot]) => k + " " + fmtInt(tot)).join(", ") + ".");

    const kv = [["in use", g.blocks_in_use], ["cached idle", g.blocks_cached_idle], ["free", g.blocks_free],
      ["of", g.num_blocks]];
    numsList($("n-kv"), kv.map(([k, v]) => [k, fmtInt(v)]));
    $("c-kv").setAttribute("aria-label", "KV occupancy in blocks: " +
      kv.map(([k, v]) => k + " " + fmtInt(v)).join(", ") + ".");

    numsList($("n-evict"), [["latest", fmtRate(ev) + "/s"], ["total", fmtInt(c.blocks_evicted)]]);
    $("c-evict").setAttribute("aria-label", "Evictions per second. Latest " + fmtRate(ev) +
      ", total " + fmtInt(c.blocks_evicted) + ".");
  }

  function barRow(label, value, frac, numText, cls) {
    return h("li", null, h("span", null, label),
      h("span", { class: "track", "aria-hidden": "true" },
        h("span", { class: "fill" + (cls ? " " + cls : ""), style: { width: (100 * Math.max(0, Math.min(1, frac))).toFixed(2) + "%" } })),
      h("span", { class: "num" }, numText));
  }

  function renderMiss(m) {
    const keys = MISS_ORDER.filter((k) => k in m).concat(Object.keys(m).filter((k) => !MISS_ORDER.includes(k)).sort());
    const total = keys.reduce((a, k) => a + num(m[k]), 0);
    const rows = keys.map((k) => {
      const v = num(m[k]);
      return barRow(MISS_TEXT[k] || k, v, total > 0 ? v / total : 0,
        fmtInt(v) + (total > 0 ? " (" + nf0.format((100 * v) / total) + " %)" : ""));
    });
    rows.forEach((r, i) => r.setAttribute("data-reason", keys[i]));
    replaceKids($("miss"), rows.length ? rows : [h("li", { class: "muted" }, "no data")]);
  }

  function renderWhatif(w) {
    const rows = [["with this pool", w.hit_rate], ["with 2× blocks", w.hit_rate_2x], ["with 4× blocks", w.hit_rate_4x]]
      .map(([k, v]) => {
        const p = typeof v === "number" ? 100 * v : null;
        return barRow(k, p, p == null ? 0 : p / 100, fmtPct(p), "s-cached");
      });
    ["now", "2x", "4x"].forEach((k, i) => rows[i].setAttribute("data-whatif", k));
    replaceKids($("whatif"), rows);
  }

  function renderDiverged(dv, recent) {
    $("div-early").textContent = fmtInt(dv.within_64);
    $("div-all").textContent = fmtInt(dv.requests);
    const pts = recent.filter((r) => typeof r.diverged_at === "number");
    $("div-recent").textContent = pts.length
      ? "Recent: " + pts.slice(0, 8).map((r) => r.request_id + " at token " + fmtInt(r.diverged_at)).join(", ")
      : "";
  }

  function renderTenants(ts) {
    const rows = ts.map((t) => {
      const hr = ratio(num(t.hits), num(t.queries));
      return h("tr", { "data-tenant": String(t.tenant) },
        h("th", { scope: "row" }, String(t.tenant)),
        h("td", null, h("span", { class: "meter", "aria-hidden": "true" },
          h("span", { style: { width: (hr == null ? 0 : hr).toFixed(1) + "%" } })), fmtPct(hr)),
        h("td", { class: "num" }, fmtInt(t.queries)),
        h("td", { class: "num" }, fmtInt(t.hits)),
        h("td", { class: "num" }, fmtInt(t.cached_tokens)));
    });
    replaceKids($("tenants"), rows.length ? rows : [h("tr", null, h("td", { colspan: "5", class: "muted" }, "no data"))]);
  }

  let recentSig = "";
  let selected = null;
  function renderRecent(recent) {
    const sig = JSON.stringify(recent) + "|" + selected;
    if (sig === recentSig) return; // unchanged: keep the DOM (and keyboard focus) as it is
    recentSig = sig;
    const focusedId = document.activeElement && document.activeElement.dataset
      ? document.activeElement.dataset.requestId : undefined;
    const max = Math.max(1, ...recent.map((r) => num(r.prompt_tokens)));
    const items = recent.map((r) => {
      const id = String(r.request_id);
      const p = num(r.prompt_tokens);
      const cached = num(r.cached_tokens);
      const computed = num(r.computed_tokens);
      const created = Math.min(num(r.cache_creation_tokens), computed);
      const w = (v) => ({ width: ((100 * v) / max).toFixed(2) + "%" });
      const text = fmtInt(cached) + " cached · " + fmtInt(computed) + " computed · " + fmtInt(created) +
        " created / " + fmtInt(p) + (typeof r.diverged_at === "number" ? " · diverged at " + fmtInt(r.diverged_at) : "") +
        (r.finish_reason ? " · " + r.finish_reason : "");
      const b = h("button", { type: "button", "data-request-id": id, "aria-pressed": String(id === selected),
        "aria-label": "Request " + id + ": " + text + ". Show its block lifecycle.",
        onclick: () => showLifecycle(id) },
        h("span", { class: "rid", title: id }, id),
        h("span", { class: "rbar", "aria-hidden": "true" },
          h("span", { class: "s-cached", style: w(cached) }),
          h("span", { class: "s-computed", style: w(computed - created) }),
          h("span", { class: "s-created", style: w(created) })),
        h("span", { class: "rtext" }, text));
      return h("li", null, b);
    });
    replaceKids($("recent"), items.length ? items : [h("li", { class: "muted" }, "no requests yet")]);
    if (focusedId !== undefined) {
      const again = Array.from($("recent").querySelectorAll("button")).find((x) => x.dataset.requestId === focusedId);
      if (again) again.focus();
    }
  }

  // ---------- block lifecycle ----------
  let lifeSeq = 0;
  async function showLifecycle(id) {
    selected = id;
    recentSig = "";
    for (const b of $("recent").querySelectorAll("button")) b.setAttribute("aria-pressed", String(b.dataset.requestId === id));
    const sec = $("lifecycle");
    sec.hidden = false;
    $("life-id").textContent = id;
    $("life-summary").textContent = "loading…";
    replaceKids($("life-strip"), []);
    replaceKids($("life-blocks"), []);
    replaceKids($("life-fields"), []);
    const seq = ++lifeSeq;
    let data;
    try {
      data = await getJson("/v1/cache/requests/" + encodeURIComponent(id));
    } catch (e) {
      if (seq !== lifeSeq) return;
      if (e instanceof Unauthorized) { askForKey(); $("life-summary").textContent = keyProblem(e); return; }
      $("life-summary").textContent = e.status === 404
        ? "This request is no longer in the server's history (--request-history)."
        : "Could not load: " + e.message;
      $("life-summary").className = "error";
      return;
    }
    if (seq !== lifeSeq) return; // a later click won
    $("life-summary").className = "";
    renderLifecycle(data);
  }

  // A block hash as the server sends it (a hex string or a number), shortened for the table.
  function fmtHash(v) {
    if (v == null || v === "") return "–";
    const t = String(v);
    return t.length > 12 ? t.slice(0, 12) + "…" : t;
  }

  function renderLifecycle(data) {
    const blocks = Array.isArray(data.blocks) ? data.blocks : [];
    const counts = {};
    for (const b of blocks) counts[b.event] = (counts[b.event] || 0) + 1;
    const order = ["hit", "loaded", "allocated", "filled", "evicted", "preempted"];
    const summary = order.filter((k) => counts[k]).map((k) => counts[k] + " " + k)
      .concat(Object.keys(counts).filter((k) => !order.includes(k)).map((k) => counts[k] + " " + k));
    $("life-summary").textContent = blocks.length + " block events: " + (summary.join(", ") || "none");
    const strip = $("life-strip");
    strip.setAttribute("aria-label", "Block lifecycle: " + (summary.join(", ") || "no blocks"));
    replaceKids(strip, blocks.map((b) => h("span", { class: "e-" + String(b.event).replace(/[^a-z]/g, ""),
      title: (b.seq == null ? "" : "sequence " + b.seq + ", ") + "block " + b.index + ": " + b.event +
        (b.owner ? " (entry of " + b.owner + ")" : "") })));
    // A request with n > 1 sequences: each event names its sequence.
    const seqOf = (b) => (b.seq == null ? "" : " (seq " + b.seq + ")");
    replaceKids($("life-blocks"), blocks.map((b) => h("tr", { "data-event": String(b.event) },
      h("td", { class: "num" }, fmtInt(b.index)),
      h("td", null, String(b.event) + (b.new_entry ? " (new entry)" : "") + seqOf(b)),
      h("td", { class: "mono", title: b.hash == null ? "" : String(b.hash) }, fmtHash(b.hash)),
      h("td", { class: "mono" }, b.owner == null ? "" : String(b.owner)))));
    const fields = [];
    const walk = (obj, prefix) => {
      for (const [k, v] of Object.entries(obj || {})) {
        if (v && typeof v === "object" && !Array.isArray(v)) walk(v, prefix + k + ".");
        else fields.push([prefix + k, v]);
      }
    };
    walk(data.prefix_cache, "");
    replaceKids($("life-fields"), fields.flatMap(([k, v]) => [h("dt", null, k),
      h("dd", { "data-field": k }, typeof v === "number" ? fmtInt(v) : v == null ? "–" : String(v))]));
  }

  // ---------- pool and hottest prefixes ----------
  async function refreshHottest() {
    let data;
    try {
      data = await getJson("/v1/cache");
    } catch (e) {
      if (e instanceof Unauthorized) return; // the stream asks for the key
      $("pool").textContent = e.status === 404 ? "The inspector is not available on this server." : "Could not load: " + e.message;
      return;
    }
    const pool = data.pool || {};
    $("pool").textContent = Object.entries(pool)
      .filter(([, v]) => typeof v === "number")
      .map(([k, v]) => k.replace(/_/g, " ") + " " + fmtInt(v)).join(" · ");
    const rows = (data.hottest || []).map((p) => h("tr", null,
      h("td", { class: "num" }, fmtInt(p.depth)),
      h("td", { class: "num" }, fmtInt(p.tokens)),
      h("td", { class: "num" }, fmtInt(p.hits)),
      h("td", { class: "num" }, fmtSecs(p.age_s)),
      h("td", { class: "num" }, p.last_hit_s == null ? "never" : fmtSecs(p.last_hit_s) + " ago"),
      h("td", { class: "mono" }, p.created_by == null ? "–" : String(p.created_by))));
    replaceKids($("hottest"), rows.length ? rows : [h("tr", null, h("td", { colspan: "6", class: "muted" }, "nothing cached"))]);
  }

  // ---------- KV cache events (GET /v1/cache/events, live from when the page opened) ----------
  const EV_MAX = 12;
  const evTotals = { stored: 0, removed: 0, cleared: 0 };
  let evRows = [];
  let evController = null;

  function evRow(ts, kind, text) {
    evRows.unshift({ ts, kind, text });
    evRows = evRows.slice(0, EV_MAX);
  }

  function onKvBatch(text) {
    let b = null;
    try { b = JSON.parse(text); } catch (_) { return; }
    if (!b || !Array.isArray(b.events)) return;
    for (const e of b.events) {
      const n = Array.isArray(e.block_hashes) ? e.block_hashes.length : 0;
      const who = (e.request_id ? " · " + e.request_id : "") + (e.medium ? " · " + e.medium : "");
      if (e.type === "BlockStored") {
        evTotals.stored += n;
        evRow(b.ts, "stored", "stored " + fmtInt(n) + (n === 1 ? " block" : " blocks") + who);
      } else if (e.type === "BlockRemoved") {
        evTotals.removed += n;
        evRow(b.ts, "removed", "removed " + fmtInt(n) + (n === 1 ? " block" : " blocks") + who);
      } else if (e.type === "AllBlocksCleared") {
        evTotals.cleared += 1;
        evRow(b.ts, "cleared", "cache cleared" + who);
      } else {
        evRow(b.ts, "other", String(e.type));
      }
    }
    renderKvEvents();
  }

  function renderKvEvents() {
    $("ev-stored").textContent = fmtInt(evTotals.stored);
    $("ev-removed").textContent = fmtInt(evTotals.removed);
    $("ev-cleared").textContent = fmtInt(evTotals.cleared);
    const items = evRows.map((r) => h("li", { "data-kind": r.kind },
      h("span", { class: "muted" }, typeof r.ts === "number" ? new Date(r.ts * 1000).toLocaleTimeString("en-GB") : ""),
      h("span", { class: "sw ev-" + r.kind, "aria-hidden": "true" }), r.text));
    replaceKids($("ev-list"), items.length ? items : [h("li", { class: "muted" }, "no events yet")]);
  }

  function setEvStatus(text) {
    $("ev-status").textContent = text;
  }

  async function runEvents() {
    if (evController) evController.abort();
    const my = new AbortController();
    evController = my;
    let wait = 1000;
    while (evController === my) {
      try {
        await readSse("/v1/cache/events", my.signal, () => {
          setEvStatus("live");
          wait = 1000;
        }, (name, text) => {
          if (name === "batch") onKvBatch(text);
          else if (name === "lagged") { evRow(Date.now() / 1000, "other", "missed " + text + " batches (page too slow)"); renderKvEvents(); }
        });
        if (evController !== my) return;
        setEvStatus("stream ended, reconnecting…");
      } catch (e) {
        if (evController !== my) return;
        if (e instanceof Unauthorized) { setEvStatus(keyProblem(e)); return; }
        if (e.status === 404) { setEvStatus("not available on this server"); return; }
        setEvStatus("disconnected, retrying");
      }
      await new Promise((res) => setTimeout(res, wait));
      wait = Math.min(10000, wait * 2);
    }
  }

  // ---------- the stream (fetch + a server-sent-events parser) ----------
  let controller = null;
  let backoff = 1000;

  // One server-sent-events stream read with fetch (so the key goes in a header): `onOpen` once
  // the response is 200, then `onEvent(name, data)` per event ("message" when it has no name).
  async function readSse(path, signal, onOpen, onEvent) {
    const r = await fetch(path, {
      headers: authHeaders({ Accept: "text/event-stream" }), cache: "no-store", signal,
    });
    if (r.status === 401 || r.status === 403) throw new Unauthorized(r.status);
    if (!r.ok || !r.body) {
      const e = new Error("HTTP " + r.status);
      e.status = r.status;
      throw e;
    }
    onOpen();
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    let evName = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        let line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) onEvent(evName || "message", data.join("\n"));
          evName = "";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue; // keep-alive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "event") evName = val;
        else if (field === "data") data.push(val);
      }
    }
  }

  function readStream(signal) {
    return readSse("/v1/cache/stats/stream", signal, () => {
      setConn("live", "live");
      backoff = 1000;
    }, (name, text) => {
      if (name !== "snapshot" && name !== "message") return;
      let s = null;
      try { s = JSON.parse(text); } catch (_) { s = null; }
      if (s) onSnapshot(s);
    });
  }

  async function runStream() {
    if (controller) controller.abort();
    const my = new AbortController();
    controller = my;
    while (controller === my) {
      try {
        await readStream(my.signal);
        if (controller !== my) return;
        setConn("wait", "stream ended, reconnecting…");
      } catch (e) {
        if (controller !== my) return;
        if (e instanceof Unauthorized) {
          setConn("down", keyProblem(e));
          askForKey();
          return;
        }
        setConn("wait", "disconnected, retrying in " + Math.round(backoff / 1000) + " s");
      }
      await new Promise((res) => setTimeout(res, backoff));
      backoff = Math.min(10000, backoff * 2);
    }
  }
  function restartStream() {
    prev = null; // a new connection may be to a restarted server
    runStream();
  }

  // ---------- start ----------
  function start() {
    loadKey();
    initCharts();
    // For tests and curious people: the charts and a snapshot count.
    window.cachetDashboard = { charts, series, get snapshots() { return snapshots; } };
    runStream();
    runEvents();
    refreshHottest();
    setInterval(() => { if (!document.hidden) refreshHottest(); }, HOTTEST_EVERY_MS);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
