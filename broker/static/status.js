// The status page: polls the job API every 2 s (the queue, the fleet, the jobs and the selected
// job) and draws the charts on <canvas>; no libraries.
"use strict";
(() => {
  const POLL_MS = 2000;
  const HEARTBEAT_STALE_S = 30;
  const TOKEN_KEY = "asyncrl-status-token";
  const COLORS = { train: "#2563eb", eval: "#dc2626", mean: "#7c3aed", max: "#f59e0b", rate: "#059669", time: "#0891b2" };

  // ?token= is kept for this tab only and dropped from the address bar (history, screenshots).
  const params = new URLSearchParams(location.search);
  let token = params.get("token");
  if (token !== null) {
    sessionStorage.setItem(TOKEN_KEY, token);
    params.delete("token");
    history.replaceState(null, "", location.pathname + (params.toString() ? `?${params}` : ""));
  } else {
    token = sessionStorage.getItem(TOKEN_KEY);
  }
  let selected = params.get("job");
  let timer = null;
  let busy = false, again = false; // one refresh at a time; a click during one queues another
  let last = null; // the last rendered {job, data}, redrawn on resize

  const $ = (id) => document.getElementById(id);

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    Object.assign(node, props);
    for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
    return node;
  }

  async function getJSON(path) {
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const resp = await fetch(path, { headers, cache: "no-store" });
    const body = await resp.json().catch(() => ({}));
    if (!resp.ok) {
      let msg = `${resp.status} ${path}: ${body.error || resp.statusText}`;
      if (resp.status === 401) msg += " (open this page as /status?token=<token>)";
      throw new Error(msg);
    }
    return body;
  }

  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (typeof v !== "number") return String(v);
    const a = Math.abs(v);
    if (Number.isInteger(v) && a < 1e6) return String(v);
    if (a >= 1000) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a === 0) return "0";
    return Number(v.toPrecision(3)).toString();
  }

  // a job's reward error fraction (timeout + error over scored), red once any reward failed
  function rewardErrors(fraction) {
    if (fraction === null || fraction === undefined) return "";
    return `reward errors ${fmt(Number((100 * fraction).toPrecision(3)))} %`;
  }

  const signed = (v) => `${v >= 0 ? "+" : ""}${v.toFixed(2)}`;
  const dist = (d) => (d ? `${fmt(d.mean)} (${fmt(d.p10)}–${fmt(d.p90)})` : "–");
  // the quantities a job's drop-skew warnings name ("completion length", "reward")
  const biased = (warnings) => warnings.map((w) => w.split(":")[0].replace("dropping biases ", "")).join(", ");

  function ago(seconds) {
    if (seconds < 60) return `${Math.max(0, seconds).toFixed(0)} s ago`;
    if (seconds < 3600) return `${(seconds / 60).toFixed(0)} min ago`;
    return `${(seconds / 3600).toFixed(1)} h ago`;
  }

  function niceTicks(lo, hi, n) {
    const span = hi - lo;
    const mag = 10 ** Math.floor(Math.log10(span / n));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || span / n;
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(v);
    return ticks;
  }

  // series: [{name, color, points: [[x, y|null], ...], dots}]; a null y breaks the line.
  function drawChart(canvas, series, opts = {}) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null && Number.isFinite(p[1])));
    if (pts.length === 0) {
      ctx.fillStyle = "#6b7280";
      ctx.textAlign = "center";
      ctx.fillText("no data yet", w / 2, h / 2);
      return;
    }
    let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
    if (opts.zero) y0 = Math.min(0, y0);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const pad = (y1 - y0) * 0.05;
    y1 += pad;
    if (!(opts.zero && y0 === 0)) y0 -= pad;
    const L = 44, R = 10, T = 20, B = 22;
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (w - L - R);
    const sy = (y) => h - B - ((y - y0) / (y1 - y0)) * (h - T - B);

    // grid and axes
    ctx.strokeStyle = "#e5e7eb";
    ctx.fillStyle = "#6b7280";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const t of niceTicks(y0, y1, 4)) {
      ctx.beginPath(); ctx.moveTo(L, sy(t)); ctx.lineTo(w - R, sy(t)); ctx.stroke();
      ctx.fillText(fmt(Number(t.toPrecision(6))), L - 4, sy(t));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const t of niceTicks(x0, x1, 6).filter(Number.isInteger)) {
      ctx.fillText(String(t), sx(t), h - B + 5);
    }
    ctx.strokeStyle = "#9ca3af";
    ctx.beginPath(); ctx.moveTo(L, T); ctx.lineTo(L, h - B); ctx.lineTo(w - R, h - B); ctx.stroke();

    // lines, then a legend with each series' latest value
    let lx = w - R;
    ctx.textBaseline = "middle";
    for (const s of [...series].reverse()) {
      ctx.strokeStyle = ctx.fillStyle = s.color;
      ctx.lineWidth = 1.8;
      ctx.beginPath();
      let pen = false;
      for (const [x, y] of s.points) {
        if (y === null || !Number.isFinite(y)) { pen = false; continue; }
        if (pen) ctx.lineTo(sx(x), sy(y)); else ctx.moveTo(sx(x), sy(y));
        pen = true;
      }
      ctx.stroke();
      const solo = s.points.filter((p) => p[1] !== null);
      if (s.dots || solo.length === 1) {
        for (const [x, y] of solo) { ctx.beginPath(); ctx.arc(sx(x), sy(y), 3, 0, 2 * Math.PI); ctx.fill(); }
      }
      const latest = solo.length ? solo[solo.length - 1][1] : null;
      const label = `${s.name} ${fmt(latest)}`;
      ctx.textAlign = "right";
      ctx.fillText(label, lx, 9);
      lx -= ctx.measureText(label).width + 14;
      ctx.fillRect(lx + 4, 5, 8, 8);
      lx -= 4;
    }
  }

  function column(steps, key) {
    return steps.map((s) => [s.step, s[key]]);
  }

  function renderCharts() {
    if (!last) return;
    const { steps, evals } = last.data;
    const held = (source, name) => evals.filter((e) => e.source === source && (name === undefined || e.name === name))
      .map((e) => [e.step, e.reward_mean]);
    const series = [
      { name: "train reward/mean", color: COLORS.train, points: column(steps, "reward/mean") },
    ];
    const sets = [...new Set(evals.filter((e) => e.source === "pipeline").map((e) => e.name))];
    sets.forEach((name, i) => series.push({
      name: name === "held_out" ? "held-out" : `eval ${name}`, color: i ? COLORS.rate : COLORS.eval,
      points: held("pipeline", name), dots: true,
    }));
    const offline = held("checkpoint");
    if (offline.length) series.push({ name: "checkpoint eval", color: COLORS.max, points: offline, dots: true });
    drawChart($("chart-reward"), series);
    drawChart($("chart-staleness"), [
      { name: "off_policy/mean", color: COLORS.mean, points: column(steps, "off_policy/mean") },
      { name: "off_policy/max", color: COLORS.max, points: column(steps, "off_policy/max") },
    ], { zero: true });
    drawChart($("chart-throughput"), [
      { name: "samples/s", color: COLORS.rate, points: column(steps, "throughput/samples_per_s") },
    ], { zero: true });
    drawChart($("chart-steptime"), [
      { name: "time/step_s", color: COLORS.time, points: column(steps, "time/step_s") },
    ], { zero: true });
  }

  function renderJobs(jobs, current) {
    const body = $("jobs").tBodies[0];
    body.replaceChildren(...jobs.map((j) => {
      const link = el("a", { href: `?job=${encodeURIComponent(j.id)}` }, el("code", {}, j.id));
      const row = el("tr", { className: j.id === current ? "selected" : "" },
        el("td", {}, link), el("td", {}, j.name), el("td", {}, el("span", { className: `state ${j.state}` }, j.state)),
        el("td", {}, j.step));
      row.addEventListener("click", (ev) => {
        ev.preventDefault();
        select(j.id);
      });
      return row;
    }));
    $("no-jobs").hidden = jobs.length > 0;
  }

  function jobLink(id, name) {
    const link = el("a", { href: `?job=${encodeURIComponent(id)}` }, name, " ", el("code", {}, id));
    link.addEventListener("click", (ev) => {
      ev.preventDefault();
      select(id);
    });
    return link;
  }

  function select(id) {
    selected = id;
    history.pushState(null, "", `?job=${encodeURIComponent(id)}`);
    refresh();
  }

  // The services serving a job, by role: "generator g0, g1; reward r0"
  const servedBy = (served) => Object.keys(served || {}).sort().map((role) => `${role} ${served[role].join(", ")}`).join("; ");

  // GET /queue: the running jobs (each one's share and who serves it), then each queued job in the
  // order a trainer takes them, with what it waits for (the running job, the jobs ahead of it, or a
  // trainer when none is up)
  function renderQueue(queue) {
    const badge = (state) => el("span", { className: `state ${state}` }, state);
    const note = (...parts) => el("div", { className: "why muted" }, parts.filter(Boolean).join(", "));
    const prio = (p) => (p ? `priority ${p}` : "");
    const rows = [
      ...queue.running.map((j) => el("tr", {}, el("td", { className: "muted" }, "▶"),
        el("td", {}, jobLink(j.id, j.name), servedBy(j.served_by) ? note(`served by ${servedBy(j.served_by)}`) : ""),
        el("td", {}, badge(j.state), note(j.steps ? `step ${j.step}/${j.steps}` : `step ${j.step}`, prio(j.priority),
          `share ${j.share ?? 1}`),
          j.reward_error_fraction ? el("div", { className: "why bad" }, rewardErrors(j.reward_error_fraction)) : "",
          (j.drop_skew_warnings || []).length ? el("div", { className: "why bad" }, `dropping biases ${biased(j.drop_skew_warnings)}`) : ""))),
      ...queue.queued.map((q) => el("tr", {}, el("td", {}, `#${q.position}`),
        el("td", {}, jobLink(q.id, q.name), note(`waiting for ${q.waiting_for}`)),
        el("td", {}, badge("queued"), note(prio(q.priority))))),
    ];
    $("queue").tBodies[0].replaceChildren(...rows);
    $("no-queue").hidden = rows.length > 0;
  }

  // GET /fleet: each live service of the fleet, as its beacon says: the jobs it serves (an entry
  // from before `jobs` names one `job`), each with its share, busy seconds and tokens when known
  function renderFleet(services) {
    const now = Date.now() / 1000;
    const served = (m) => (m.jobs && m.jobs.length ? m.jobs : m.job ? [m.job] : []).flatMap((id) => {
      const load = (m.load || {})[id];
      return [" ", jobLink(id, ""), load ? el("span", { className: "muted" }, ` (share ${load.share}, ${fmt(load.seconds)} s, ${load.tokens} tok)`) : ""];
    });
    $("fleet").tBodies[0].replaceChildren(...services.map((m) => el("tr", {},
      el("td", { title: `${m.host} pid ${m.pid}` }, m.role, " ", el("code", {}, m.id)),
      el("td", {}, m.state, ...served(m),
        el("div", { className: "why muted" }, `since ${ago(now - m.since)}, ${m.jobs_served} job(s) served`)))));
    $("no-fleet").hidden = services.length > 0;
  }

  function fillDl(dl, entries) {
    dl.replaceChildren(...entries.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, fmt(v))]));
    if (entries.length === 0) dl.append(el("dt", { className: "muted" }, "none yet"));
  }

  function renderGenerators(generators) {
    const now = Date.now() / 1000;
    const rows = Object.entries(generators).sort(([a], [b]) => a.localeCompare(b)).map(([gid, g]) => {
      const hb = g.heartbeat;
      const versions = g.versions_loaded || [];
      const shown = versions.length > 6 ? `…, ${versions.slice(-6).join(", ")}` : versions.join(", ");
      const loaded = g.last_loaded_at ? new Date(g.last_loaded_at).toLocaleTimeString() : "–";
      let beat = el("span", { className: "muted" }, "none");
      if (hb && typeof hb.ts === "number") {
        const age = now - hb.ts;
        beat = el("span", { className: age > HEARTBEAT_STALE_S ? "stale" : "" }, ago(age));
      }
      return el("tr", {}, el("td", {}, el("code", {}, gid)), el("td", {}, hb ? fmt(hb.version) : "–"),
        el("td", {}, `${shown} (${versions.length})`), el("td", {}, loaded), el("td", {}, beat));
    });
    if (rows.length === 0) rows.push(el("tr", {}, el("td", { colSpan: 5, className: "muted" }, "no generator has reported yet")));
    $("generators").tBodies[0].replaceChildren(...rows);
  }

  // every collapse-guard trip (trainer_svc/guard.py), from the job's change log: a roll-back, a
  // kept policy or a restart changes what the curves mean, so it sits above them
  function renderGuard(trips) {
    $("guard").hidden = trips.length === 0;
    $("guard-title").textContent = `collapse guard tripped ${trips.length} time${trips.length === 1 ? "" : "s"}`;
    $("guard-trips").replaceChildren(...trips.map((t) => el("li", {}, t.text)));
  }

  // what dropping skews (GET /jobs/{id} drop_skew): the samples kept out of the gradient against
  // those trained, by length and reward; a warning past the job's drop_skew.max_shift sits above
  // the charts, since the curves show only what was trained
  function renderDropSkew(skew) {
    const warnings = (skew && skew.warnings) || [];
    const dropped = skew ? skew.dropped.count : 0;
    $("drop-warn").hidden = warnings.length === 0;
    $("drop-warnings").replaceChildren(...warnings.map((w) => el("li", {}, w)));
    const shifts = Object.entries((skew && skew.shift) || {}).filter(([, s]) => s).map(([q, s]) => `${q} ${signed(s.mean)}`);
    $("job-drop-skew").textContent = dropped ? `dropped ${dropped}, shift ${shifts.join(", ") || "none"}` : "";
    $("job-drop-skew").className = warnings.length ? "bad" : "muted";
    const sides = dropped ? [["trained", skew.trained], ["dropped", skew.dropped],
      ...Object.entries(skew.by_reason || {}).map(([reason, side]) => [`· ${reason}`, side])] : [];
    $("drop-skew").tBodies[0].replaceChildren(...sides.map(([name, side]) => el("tr", {},
      el("td", {}, name), el("td", {}, fmt(side.count)), el("td", {}, dist(side.length)), el("td", {}, dist(side.reward)))));
    $("drop-skew").hidden = !dropped;
    $("no-drops").hidden = Boolean(dropped);
  }

  function renderJob(job, data) {
    $("job").hidden = false;
    $("job-name").textContent = job.name;
    $("job-id").textContent = job.id;
    $("job-state").textContent = job.state;
    $("job-state").className = `state ${job.state}`;
    $("job-step").textContent = `step ${job.step}`;
    const fraction = job.reward_errors ? job.reward_errors.fraction : null;
    $("job-reward-errors").textContent = rewardErrors(fraction);
    $("job-reward-errors").className = fraction ? "bad" : "muted";
    $("job-error").hidden = !job.error;
    $("job-error").textContent = job.error || "";
    document.title = `${job.name} (${job.state}) · asyncrl status`;
    last = { job, data };
    renderGuard(data.guard_trips || []);
    renderDropSkew(job.drop_skew);
    renderCharts();
    renderGenerators(job.generators || {});
    fillDl($("samples"), Object.entries(job.samples || {}));
    fillDl($("reward-status"), Object.entries((job.reward_errors || {}).by_status || {}));
    fillDl($("staleness"), Object.entries(job.staleness || {}).map(([lag, n]) => [`${lag} behind`, n]));
    // GET /jobs/{id} `usage`: the job's generator-seconds and tokens, once it generated a sample
    const usage = job.usage || {};
    fillDl($("usage"), usage.samples ? [
      ["generator-seconds", usage.generator_seconds],
      ["samples", usage.samples],
      ["prompt tokens", usage.prompt_tokens],
      ["completion tokens", usage.completion_tokens],
      ["generators", Object.keys(usage.by_generator || {}).length],
      ...(usage.adapters ? [["adapters", usage.adapters]] : []),
    ] : []);
    fillDl($("last-metrics"), Object.entries(job.last_metrics || {}).sort(([a], [b]) => a.localeCompare(b)));
  }

  function setError(message) {
    $("error").hidden = !message;
    $("error").textContent = message || "";
  }

  async function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    clearTimeout(timer);
    try {
      const [jobs, queue, fleet] = await Promise.all([getJSON("/jobs?limit=50"), getJSON("/queue"), getJSON("/fleet")]);
      const id = selected || (jobs.length ? jobs[0].id : null);
      renderQueue(queue);
      renderFleet(fleet.services);
      renderJobs(jobs, id);
      if (id) {
        const path = encodeURIComponent(id);
        const [job, data] = await Promise.all([getJSON(`/jobs/${path}`), getJSON(`/status/data/${path}`)]);
        renderJob(job, data);
      } else {
        $("job").hidden = true;
      }
      setError(null);
      $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      setError(err.message);
    } finally {
      busy = false;
      if (again) { again = false; refresh(); } else timer = setTimeout(refresh, POLL_MS);
    }
  }

  window.addEventListener("popstate", () => {
    selected = new URLSearchParams(location.search).get("job");
    refresh();
  });
  window.addEventListener("resize", renderCharts);
  refresh();
})();
