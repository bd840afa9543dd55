// The renderfarm dashboard: polls the status API every 1.5 s and redraws with plain DOM calls.
// Inlined into GET / by infra/api/routes/dashboard.py; no build step, nothing from the internet.
// Every value shown goes through textContent or an attribute, never through HTML parsing:
// prompts, error messages and worker names are user input.
"use strict";

(() => {
  const POLL_MS = 1500;
  const HIDDEN_POLL_MS = 10000;
  const KEY_ITEM = "renderfarm.apiKey";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#0969da", "#1a7f37", "#bf8700", "#8250df", "#cf222e", "#1b7c83", "#bc4c00", "#6e7781"];

  class AuthNeeded extends Error {}

  // ---- fetching -----------------------------------------------------------------------------
  function authHeaders() {
    const key = sessionStorage.getItem(KEY_ITEM);
    return key ? { "X-API-Key": key } : {};
  }

  async function getJSON(path) {
    const response = await fetch(path, { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) throw new AuthNeeded("this farm needs an API key");
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  // ---- small DOM helpers --------------------------------------------------------------------
  function el(tag, attrs = {}, text = null) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    if (text !== null) node.textContent = text;
    return node;
  }

  function svg(tag, attrs = {}, text = null) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    if (text !== null) node.textContent = text;
    return node;
  }

  // A cell is a string/number (shown as text), null (an en dash), or a function that fills the
  // <td> itself (it is given the cell, which it may reuse from the previous redraw).
  function setCell(td, value) {
    if (typeof value === "function") {
      value(td);
      return;
    }
    const text = value === null || value === undefined || value === "" ? "–" : String(value);
    if (td.textContent !== text) td.textContent = text;
  }

  // Redraw a table's body from items, reusing the row of each key so that nothing flickers.
  // columns: [{cell: item => value, cls?: "num"|…}]
  function fillTable(table, items, key, columns, emptyText) {
    const body = table.tBodies[0];
    if (!items.length) {
      const row = el("tr", { class: "none" });
      row.append(el("td", { colspan: String(columns.length) }, emptyText));
      body.replaceChildren(row);
      return;
    }
    const previous = new Map([...body.rows].map((tr) => [tr.dataset.key, tr]));
    const rows = items.map((item) => {
      const k = String(key(item));
      let tr = previous.get(k);
      if (!tr) {
        tr = document.createElement("tr");
        tr.dataset.key = k;
        for (const column of columns) tr.append(el("td", column.cls ? { class: column.cls } : {}));
      }
      columns.forEach((column, i) => setCell(tr.cells[i], column.cell(item)));
      return tr;
    });
    body.replaceChildren(...rows);
  }

  function shortId(id) {
    return (td) => {
      let code = td.firstElementChild;
      if (!code) td.replaceChildren((code = el("code")));
      code.textContent = String(id || "").slice(0, 8);
      td.title = id || "";
    };
  }

  function styled(text, cls, title = "") {
    return (td) => {
      td.textContent = text;
      td.className = cls;
      td.title = title;
    };
  }

  function ago(iso) {
    if (!iso) return null;
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return new Date(iso).toLocaleString();
  }

  function fixed(x, digits) {
    return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : null;
  }

  // ---- sections -----------------------------------------------------------------------------
  function drawPools(rows) {
    const n = (field) => ({ cell: (r) => r[field], cls: "num" });
    fillTable(document.getElementById("pools"), rows, (r) => r.pool,
      [{ cell: (r) => r.pool }, n("queued"), n("reserved"), n("running"), n("outstanding"), n("workers")],
      "no pool has work or workers");
  }

  function deviceText(device) {
    if (!device || typeof device !== "object") return device ? String(device) : null;
    const where = device.kind === "cuda" || device.kind === "xpu" || device.kind === "npu"
      ? `${device.kind}:${device.index ?? 0}` : device.kind;
    return device.name ? `${where} · ${device.name}` : where;
  }

  function recipeText(recipe) {
    if (!recipe) return null;
    return typeof recipe === "object" ? recipe.name || JSON.stringify(recipe).slice(0, 40) : String(recipe);
  }

  // loading → sizing → warming → ready: a starting worker shows its state, the renders done of
  // the state's total (sizing, warming) and the seconds left (estimated from the last start)
  function stateText(w) {
    if (!w.state || w.state === "ready") return w.state || "ready";
    const p = w.warmup || {};
    const count = p.total == null ? "" : ` ${p.done ?? 0}/${p.total}`;
    const eta = p.eta_s == null ? "" : ` · ~${Math.round(p.eta_s)} s left`;
    return styled(`${w.state}${count}${eta}`, "warn");
  }

  function drawWorkers(workers) {
    fillTable(document.getElementById("workers"), workers, (w) => w.name, [
      { cell: (w) => w.name },
      { cell: (w) => w.pool },
      { cell: (w) => deviceText(w.device) },
      { cell: (w) => recipeText(w.recipe) },
      { cell: (w) => w.batch_size, cls: "num" },
      { cell: (w) => (w.buckets || []).join(" ") },
      { cell: stateText },
      { cell: (w) => (w.recompiles == null ? null : styled(String(w.recompiles), w.recompiles > 0 ? "num warn" : "num")) },
      { cell: (w) => (w.compiled_renders == null && w.eager_renders == null ? null
        : styled(`${w.compiled_renders ?? "–"} / ${w.eager_renders ?? "–"}`, w.eager_renders > 0 ? "num warn" : "num")) },
      { cell: (w) => styled(`${fixed(w.heartbeat_age_s, 1) ?? "?"} s`, w.heartbeat_age_s > 10 ? "num warn" : "num") },
      { cell: (w) => fixed(w.images_per_s, 2), cls: "num" },
      { cell: (w) => w.images_done ?? 0, cls: "num" },
      { cell: (w) => (w.current_jobs || []).length, cls: "num" },
      { cell: (w) => (w.healthy === false ? styled("breaker open", "bad") : styled("ok", "ok")) },
    ], "no live worker");
  }

  function progressCell(batch) {
    return (td) => {
      let bar = td.querySelector("progress");
      let pct = td.querySelector(".pct");
      if (!bar) {
        bar = el("progress", { max: "1" });
        pct = el("span", { class: "pct" });
        td.replaceChildren(bar, pct);
      }
      bar.value = batch.progress;
      bar.title = `${(batch.progress * 100).toFixed(1)}%`;
      pct.textContent = `${Math.floor(batch.progress * 100)}%`;
    };
  }

  function batchState(b) {
    const c = b.counts;
    if (!b.done) return c.running ? styled("running", "warn") : styled("queued", "muted");
    if (c.failed) return styled(`done, ${c.failed} failed`, "bad");
    if (c.canceled === b.total) return styled("canceled", "muted");
    return styled("done", "ok");
  }

  function drawBatches(batches) {
    const count = (state) => ({ cell: (b) => b.counts[state] ?? 0, cls: "num" });
    fillTable(document.getElementById("batches"), batches, (b) => b.batch_id, [
      { cell: (b) => shortId(b.batch_id) },
      { cell: (b) => ago(b.created_at) },
      { cell: (b) => b.total, cls: "num" },
      count("queued"), count("running"), count("succeeded"), count("failed"), count("canceled"),
      { cell: (b) => progressCell(b) },
      { cell: (b) => batchState(b) },
    ], "no batch submitted yet");
  }

  // A retry button per failure (a job that fails again gets a fresh one: its finish time changed).
  function retryCell(job) {
    return (td) => {
      if (td.firstElementChild && td.dataset.finished === String(job.finished_at)) return;
      td.dataset.finished = String(job.finished_at);
      const button = el("button", { type: "button", class: "retry" }, "retry");
      button.addEventListener("click", async () => {
        button.disabled = true;
        button.textContent = "retrying…";
        try {
          const response = await fetch(`/v1/dead-letter/${encodeURIComponent(job.job_id)}/retry`,
            { method: "POST", headers: authHeaders(), cache: "no-store" });
          button.textContent = response.ok ? "queued again" : `refused: HTTP ${response.status}`;
          button.disabled = response.ok;
        } catch (exc) {
          button.textContent = `failed: ${exc.message || exc}`;
          button.disabled = false;
        }
      });
      td.replaceChildren(button);
    };
  }

  function drawFailed(jobs) {
    fillTable(document.getElementById("failed"), jobs, (j) => j.job_id, [
      { cell: (j) => ago(j.finished_at) },
      { cell: (j) => shortId(j.job_id) },
      { cell: (j) => shortId(j.batch_id) },
      { cell: (j) => j.worker },
      { cell: (j) => j.attempts, cls: "num" },
      { cell: (j) => (j.error ? j.error.type : null) },
      { cell: (j) => (j.error ? j.error.message : null), cls: "message" },
      { cell: (j) => (j.request ? j.request.prompt : null), cls: "prompt" },
      { cell: (j) => retryCell(j) },
    ], "no failed job");
  }

  // /healthz: the services of `renderfarm up` that are down, and its supervisor's newest lines
  // (the section stays hidden on a farm that no local stack supervises)
  function drawStack(health) {
    const lines = health.stack_events || [];
    const down = (health.checks || {}).stack;
    document.getElementById("stack").hidden = !lines.length && !down;
    document.getElementById("stack-summary").textContent = down ? `down now: ${down}` : `status: ${health.status}`;
    const list = document.getElementById("stack-events");
    list.replaceChildren(...lines.map((line) => el("li", {}, line)));
  }

  // Stacked bars: images per minute and pool over the last hour, the current minute last.
  function drawThroughput(data) {
    const chart = document.getElementById("tput");
    const pools = Object.keys(data.pools).sort();
    const minutes = pools.length ? data.pools[pools[0]].length : 60;
    const totals = Array.from({ length: minutes }, (_, i) => pools.reduce((s, p) => s + data.pools[p][i], 0));
    const top = Math.max(1, ...totals);
    const W = Math.max(300, chart.clientWidth || 600), H = 170, left = 34, bottom = 18, plotH = H - bottom - 8;
    const step = (W - left - 4) / minutes;
    chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const nodes = [
      svg("line", { class: "axis", x1: left, y1: H - bottom, x2: W, y2: H - bottom }),
      svg("text", { x: left - 4, y: 12, "text-anchor": "end" }, String(top)),
      svg("text", { x: left - 4, y: H - bottom, "text-anchor": "end" }, "0"),
      svg("text", { x: left, y: H - 4 }, "−60 min"),
      svg("text", { x: left + (W - left) / 2, y: H - 4, "text-anchor": "middle" }, "−30 min"),
      svg("text", { x: W - 4, y: H - 4, "text-anchor": "end" }, "now"),
    ];
    for (let i = 0; i < minutes; i++) {
      let y = H - bottom;
      const when = new Date((data.start + i * data.minute_s) * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
      pools.forEach((pool, p) => {
        const n = data.pools[pool][i];
        if (!n) return;
        const h = (n / top) * plotH;
        y -= h;
        const bar = svg("rect", { x: left + i * step + 0.5, y, width: Math.max(1, step - 1), height: h,
          fill: COLORS[p % COLORS.length] });
        bar.append(svg("title", {}, `${when} ${pool}: ${n} images`));
        nodes.push(bar);
      });
    }
    chart.replaceChildren(...nodes);
    const hour = totals.reduce((a, b) => a + b, 0);
    // images/s over the last five whole minutes plus the current partial one
    const elapsed = 5 * data.minute_s + (data.now - (data.start + (minutes - 1) * data.minute_s));
    const recent = totals.slice(-6).reduce((a, b) => a + b, 0) / elapsed;
    document.getElementById("tput-summary").textContent =
      `images per minute, last hour: ${hour} images; last 5 min: ${recent.toFixed(2)} images/s`;
    const legend = document.getElementById("tput-legend");
    legend.replaceChildren(...pools.map((pool, p) => {
      const item = el("span");
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = COLORS[p % COLORS.length];
      item.append(swatch, document.createTextNode(`${pool}: ${data.pools[pool].reduce((a, b) => a + b, 0)}`));
      return item;
    }));
  }

  // ---- polling ------------------------------------------------------------------------------
  const SOURCES = [
    ["/v1/queues", drawPools],
    ["/v1/workers", drawWorkers],
    ["/v1/batches?limit=20", drawBatches],
    ["/v1/dead-letter?limit=50", (page) => drawFailed(page.jobs)],
    ["/v1/throughput?minutes=60", drawThroughput],
    ["/v1/gallery?limit=24", (page) => gallery.draw(page)],
    ["/healthz", drawStack],
  ];

  function showStatus(text, isError) {
    const status = document.getElementById("status");
    status.textContent = text;
    status.classList.toggle("error", isError);
    document.body.classList.toggle("stale", isError);
  }

  const gallery = renderfarmGallery({ getJSON, el, showStatus });

  async function refresh() {
    const results = await Promise.allSettled(SOURCES.map(([path]) => getJSON(path)));
    const errors = [];
    results.forEach((result, i) => {
      if (result.status === "rejected") {
        errors.push(result.reason);
        return;
      }
      try {
        SOURCES[i][1](result.value);
      } catch (exc) {
        errors.push(exc);
      }
    });
    const auth = errors.find((e) => e instanceof AuthNeeded);
    document.getElementById("auth").hidden = !auth;
    if (errors.length) {
      showStatus(`${auth ? auth.message : errors[0].message || errors[0]} (retrying)`, true);
    } else {
      showStatus(`live · updated ${new Date().toLocaleTimeString()}`, false);
    }
  }

  async function tick() {
    try {
      await refresh();
    } catch (exc) {
      showStatus(`error: ${exc.message || exc} (retrying)`, true);
    } finally {
      setTimeout(tick, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
    }
  }


  document.getElementById("auth").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("api-key");
    if (input.value.trim()) sessionStorage.setItem(KEY_ITEM, input.value.trim());
    input.value = "";
    refresh();
  });

  tick();
})();
