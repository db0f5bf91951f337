// Draws the pacer run report from the JSON embedded in #pacer-data (schema pacer.report.data/1).
// After drawing, <body> carries data-rendered="N" (charts drawn), data-chart-sizes, data-marks (marks
// drawn per chart) and data-errors (messages of any error), which the integration test reads from the DOM.
(function () {
  "use strict";
  const errors = [];
  window.addEventListener("error", (e) => { errors.push(String(e.message)); document.body.dataset.errors = errors.join(" | "); });
  const data = JSON.parse(document.getElementById("pacer-data").textContent);
  const app = document.getElementById("app");
  app.textContent = "";

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
    return e;
  }
  const pct = (v) => (v == null ? "-" : (100 * v).toFixed(0) + "%");
  const when = (t) => (t == null ? "-" : new Date(t * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z"));
  function color(i, n) { return "hsl(" + Math.round((360 * i) / Math.max(n, 1)) + ", 65%, 45%)"; }

  const run = data.run || {};
  app.append(el("h1", {}, "pacer report: run " + run.run_id + (run.job_id ? " (job " + run.job_id + ")" : "")));
  app.append(el("div", { class: "meta" }, [
    "command: " + (run.command || "-"), "host: " + (run.hostname || "-"), "started: " + when(run.started),
    "ended: " + when(run.ended), "exit code: " + (run.exit_code == null ? "-" : run.exit_code),
    "pacer " + (run.pacer_version || "?"), "catalog: " + data.db].join("  ·  ")));
  if (run.catalog_status && run.catalog_status !== "ok")
    app.append(el("div", { class: "verdict" }, "The catalog stopped writing: " + run.catalog_status + ". Data after that point is missing."));

  // Scores and verdict.
  const score = data.score || {};
  const verdict = score.verdict || {};
  const bad = !["idle", "unknown", "unsaturated"].includes(verdict.kind);
  app.append(el("div", { class: "verdict" + (bad ? "" : " ok"), id: "verdict" }, verdict.sentence || "no verdict"));
  const st = el("table", { id: "scores" }, el("tr", {}, el("th", {}, "resource"), el("th", {}, "score"), el("th", {}, ""), el("th", {}, "evidence")));
  for (const s of score.scores || []) {
    const ev = s.score == null ? "not judged: " + s.why_not
      : s.evidence.map((e) => e.what + " " + (e.unit === "ratio" ? pct(e.value) : e.unit === "B/s" ? (e.value / 1e9).toPrecision(3) + " GB/s"
        : Number(e.value).toPrecision(3) + " " + e.unit) + " [" + e.source + "]").join("; ");
    const bar = el("span", { class: "track" }, el("span", { class: "bar" + (s.score >= 0.7 ? " hi" : ""), style: "width:" + Math.round(160 * (s.score || 0)) + "px" }));
    st.append(el("tr", {}, el("td", {}, s.name), el("td", {}, s.score == null ? "-" : s.score.toFixed(2)), el("td", {}, bar), el("td", {}, ev)));
  }
  app.append(el("h2", {}, "Saturation scores"), st);
  if ((score.not_judged || []).length) app.append(el("p", { class: "note" }, "Not judged: " + score.not_judged.join("; ")));

  // Timelines: one uPlot chart per metric, one line per GPU, node or rank.
  // uPlot sizes and draws its canvas after construction; the first draw hook
  // of each chart records the canvas size and how many sampled pixels it
  // painted, and the last one marks the page as rendered.
  let charts = 0, drawn = 0;
  const sizes = [], markCounts = [];
  function firstDraw(title, marked) {
    let done = false;
    return (u) => {
      if (done) return;
      done = true;
      const c = u.ctx.canvas;
      const img = u.ctx.getImageData(0, 0, c.width, c.height).data;
      let ink = 0;
      for (let i = 3; i < img.length; i += 4 * 7) if (img[i] !== 0) ink++;
      sizes.push(title.replace(/\s+/g, "_") + ":" + c.width + "x" + c.height + ":" + ink);
      markCounts.push(title.replace(/\s+/g, "_") + ":" + marked.count);
      drawn += 1;
      if (drawn === charts) finish();
    };
  }

  // Checkpoints, restarts, hangs and vet results: a dashed vertical line each, on every timeline.
  const marks = data.marks || [];
  const MARK = {
    checkpoint: { color: "#2e7d32", letter: "C", dash: [4, 3], name: "checkpoint" },
    restart: { color: "#c0392b", letter: "R", dash: [], name: "restart" },
    hang: { color: "#8e44ad", letter: "H", dash: [], name: "hang" },
    vet: { color: "#d68910", letter: "V", dash: [2, 2], name: "vet result" },
  };
  // Where a mark goes on a step axis: the last step that ended by its time (a
  // checkpoint after that step, a restart resuming after it), or the first step.
  function stepAt(points, t) {
    let best = null, first = null;
    for (const [step, pt] of points) {
      if (first == null || step < first) first = step;
      if (pt <= t && (best == null || step > best)) best = step;
    }
    return best == null ? first : best;
  }
  function markHook(toX, marked) {
    return (u) => {
      const ctx = u.ctx, dpr = window.devicePixelRatio || 1;
      const { left, top, width, height } = u.bbox;
      let n = 0;
      ctx.save();
      ctx.lineWidth = 1.5 * dpr;
      ctx.font = Math.round(10 * dpr) + "px sans-serif";
      for (const m of marks) {
        const style = MARK[m.class], x = toX(m);
        if (!style || x == null) continue;
        const px = u.valToPos(x, "x", true);
        if (!(px >= left - 1 && px <= left + width + 1)) continue;
        ctx.strokeStyle = style.color;
        ctx.fillStyle = style.color;
        ctx.setLineDash(style.dash.map((d) => d * dpr));
        ctx.beginPath();
        ctx.moveTo(px, top);
        ctx.lineTo(px, top + height);
        ctx.stroke();
        ctx.fillText(style.letter, px + 2 * dpr, top + 10 * dpr);
        n++;
      }
      ctx.restore();
      marked.count = n;
    };
  }

  const span = data.time || {};
  const width = Math.max(480, Math.min(760, (window.innerWidth || 1400) / 2 - 48));
  // seriesMap: label -> {t, v} (a time axis) or {step, t, v} (a step axis, the time shown on hover).
  function chart(parent, title, seriesMap, unit, scale, byStep) {
    const labels = Object.keys(seriesMap || {}).sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    if (!labels.length) return;
    const xOf = (l) => (byStep ? seriesMap[l].step : seriesMap[l].t);
    const xs = Array.from(new Set(labels.flatMap(xOf))).sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const cols = labels.map((l) => {
      const col = new Array(xs.length).fill(null);
      xOf(l).forEach((x, i) => { const v = seriesMap[l].v[i]; col[index.get(x)] = v == null ? null : v * (scale || 1); });
      return col;
    });
    // On a step axis, each step's wall time (its first rank's) for the hover and the marks.
    const timeOf = new Map(), points = [];
    if (byStep)
      for (const l of labels) seriesMap[l].step.forEach((x, i) => {
        if (!timeOf.has(x)) timeOf.set(x, seriesMap[l].t[i]);
        points.push([x, seriesMap[l].t[i]]);
      });
    const box = el("div", { class: "chart", "data-chart": title });
    parent.append(box);
    const marked = { count: 0 };
    const opts = {
      title: title, width: width, height: 220,
      // Every time axis spans the whole run, so that the charts line up and each mark inside the run is drawn.
      scales: { x: byStep ? { time: false } : { time: true, range: () => [span.start, span.end] } },
      series: [byStep ? { label: "step", value: (u, v) => (v == null ? "-" : "step " + v + " · " + when(timeOf.get(v))) } : {}]
        .concat(labels.map((l, i) => ({ label: l, stroke: color(i, labels.length), width: 1.5, spanGaps: byStep,
          value: (u, v) => (v == null ? "-" : v.toPrecision(3) + " " + unit) }))),
      axes: [byStep ? { label: "step" } : {}, { label: unit, size: 60 }],
      legend: { show: labels.length <= 16 },
      hooks: { draw: [markHook(byStep ? (m) => stepAt(points, m.t) : (m) => m.t, marked), firstDraw(title, marked)] },
    };
    charts += 1;
    return new uPlot(opts, [xs].concat(cols), box);
  }

  if (marks.length) {
    const counts = {};
    for (const m of marks) counts[m.class] = (counts[m.class] || 0) + 1;
    const key = el("p", { class: "meta", id: "marks" }, "Marked on the timelines: ");
    for (const [cls, style] of Object.entries(MARK))
      if (counts[cls]) key.append(el("span", { style: "color:" + style.color + ";margin-right:12px" },
        style.letter + " " + style.name + " (" + counts[cls] + ")"));
    if (data.marks_truncated) key.append(" (only the first " + marks.length + ")");
    app.append(key);
  }

  // Training curves against the step: loss, tokens/s and MFU per rank.
  const tr = data.training || {};
  const has = (m) => m && Object.keys(m).length;
  // One curve per rank of those that have any value of it, in chart()'s form.
  function curves(key) {
    const out = {};
    for (const [label, r] of Object.entries(tr.ranks || {}))
      if (r[key] && r[key].some((v) => v != null)) out[label] = { step: r.step, t: r.t, v: r[key] };
    return out;
  }
  const trainingCharts = [["Loss per rank", curves("loss"), ""], ["Tokens/s per rank", curves("tokens_per_s"), "tokens/s"]];
  if (tr.rate === "mfu") trainingCharts.push(["MFU per rank", curves("rate"), "%", 100]);
  else if (tr.rate === "model_flops_per_s") trainingCharts.push(["Model TFLOP/s per rank", curves("rate"), "TFLOP/s", 1e-12]);
  app.append(el("h2", {}, "Training"));
  if (!trainingCharts.some((c) => has(c[1]))) app.append(el("p", { class: "note" }, "No loss or tokens in this run's steps."));
  else {
    const grid = el("div", { class: "grid", id: "training" });
    app.append(grid);
    for (const c of trainingCharts) if (has(c[1])) chart(grid, c[0], c[1], c[2], c[3], true);
    const how = [];
    if (tr.step_bucket > 1) how.push("each point the mean of " + tr.step_bucket + " steps");
    if (tr.flops_from) how.push("model FLOPs from " + tr.flops_from + (tr.peak_flops ? ", peak " + (tr.peak_flops / 1e12).toPrecision(4) + " TFLOP/s from " + tr.peak_from : ""));
    else how.push("no MFU: give the steps flops= or pacer report --plan");
    if (tr.rate === "model_flops_per_s") how.push("no MFU without a GPU peak: --peak-tflops");
    app.append(el("p", { class: "meta", id: "training-source" }, how.join("; ")));
  }

  const s = data.series || {};
  const steps = data.steps || {};
  const sections = [
    ["Training steps", [["Step time per rank", steps.step_time_s, "s"], ["Data wait per rank", steps.data_wait_s, "s"],
      ["Communication per rank", steps.comm_s, "s"]]],
    ["GPU activity per GPU", [["SM activity (GPM)", s["gpm.sm_util"], "%", 100], ["Tensor activity (GPM)", s["gpm.tensor_util"], "%", 100],
      ["DRAM bandwidth (GPM)", s["gpm.dram_bw_util"], "%", 100], ["Utilization (NVML)", s["gpu.util"], "%", 100]]],
    ["GPU power and temperature", [["Power", s["gpu.power_w"], "W"], ["Temperature", s["gpu.temperature_c"], "°C"]]],
    ["Host per node", [["CPU busy (all CPUs)", s["cpu.busy"], "%", 100], ["Command's processes", s["proc.cpu_seconds"], "cores"]]],
  ];
  for (const [name, list] of sections) {
    const present = list.filter((c) => c[1] && Object.keys(c[1]).length);
    if (!present.length) { app.append(el("h2", {}, name), el("p", { class: "note" }, "No data in this run.")); continue; }
    const grid = el("div", { class: "grid" });
    app.append(el("h2", {}, name), grid);
    for (const c of present) chart(grid, c[0], c[1], c[2], c[3], false);
  }

  // Per-node heatmap: rows are nodes, columns time buckets, colour the mean activity.
  const heat = data.heatmap || {};
  const nodes = Object.keys(heat.nodes || {}).sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
  app.append(el("h2", {}, "Per-node heatmap" + (heat.metric ? " (" + heat.metric + ", mean per " + Number(heat.bucket_s).toPrecision(3) + " s)" : "")));
  if (!nodes.length) app.append(el("p", { class: "note" }, "No samples in this run."));
  else {
    const table = el("table", { class: "heat", id: "heatmap" });
    const cellWidth = Math.max(3, Math.min(24, Math.floor(1200 / Math.max(1, heat.buckets))));
    for (const n of nodes) {
      const row = el("tr", {}, el("th", {}, n));
      const cells = new Array(heat.buckets).fill(null);
      for (const [b, v] of heat.nodes[n]) if (b >= 0 && b < cells.length) cells[b] = v;
      for (let b = 0; b < cells.length; b++) {
        const v = cells[b];
        const bg = v == null ? "#f4f6f8" : "hsl(" + Math.round(220 - 220 * Math.min(1, Math.max(0, v))) + ", 70%, " + Math.round(88 - 40 * Math.min(1, Math.max(0, v))) + "%)";
        const td = el("td", { class: "c", style: "background:" + bg + ";width:" + cellWidth + "px", title: n + " " + when(heat.start + b * heat.bucket_s) + ": " + pct(v) });
        row.append(td);
      }
      table.append(row);
    }
    app.append(table, el("p", { class: "meta" }, "blue: idle, red: busy, grey: no sample"));
  }

  // The goodput ledger (docs/goodput.md): where the allocation's time went.
  const gp = data.goodput;
  if (gp && gp.buckets) {
    const gt = el("table", { id: "goodput" }, el("tr", {}, ...["bucket", "seconds", "GPU-hours", "share"].map((h) => el("th", {}, h))));
    for (const b of gp.buckets)
      gt.append(el("tr", { title: b.how }, el("td", {}, b.name), el("td", {}, b.seconds.toFixed(2)), el("td", {}, b.gpu_hours.toFixed(4)),
        el("td", {}, pct(b.share))));
    const loss = gp.largest_loss || {};
    app.append(el("h2", {}, "Goodput"), el("p", { class: "meta" }, "planned step " + Number(gp.planned_step_s).toPrecision(3) + " s (" + gp.planned_from + ")"),
      gt, el("p", { class: "note", id: "goodput-advice" }, "Largest loss: " + loss.bucket + " (" + pct(loss.share || 0) + "): " + loss.advice));
  }

  // Vet results and the other events.
  const events = data.events || [];
  function eventTable(id, list) {
    const t = el("table", { id: id }, el("tr", {}, ...["time", "kind", "node", "rank", "gpu", "detail"].map((h) => el("th", {}, h))));
    for (const e of list) t.append(el("tr", {}, el("td", {}, when(e.t)), el("td", {}, e.kind), el("td", {}, e.node), el("td", {}, e.rank),
      el("td", {}, e.gpu), el("td", {}, e.detail)));
    return t;
  }
  const vet = events.filter((e) => String(e.kind).startsWith("vet"));
  const other = events.filter((e) => !String(e.kind).startsWith("vet"));
  app.append(el("h2", {}, "Vet results"), vet.length ? eventTable("vet", vet) : el("p", { class: "note" }, "No vet results recorded in this run."));
  app.append(el("h2", {}, "Events"), other.length ? eventTable("events", other) : el("p", { class: "note" }, "No events."));
  if (data.events_truncated) app.append(el("p", { class: "note" }, "Only the first " + events.length + " events are listed."));

  function finish() {
    document.body.dataset.chartSizes = sizes.join(" ");
    document.body.dataset.marks = markCounts.join(" ");
    document.body.dataset.rendered = String(drawn);
  }
  if (charts === 0) finish();
})();
