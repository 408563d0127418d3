// The cohort status page: polls status.json every second and draws every job.
// Everything the coordinator sends is put in the page as text (textContent, SVG attributes
// set one by one), never parsed as HTML.
"use strict";

(function () {
  const POLL_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";

  // A ?token= is kept in memory only and sent as a header; the address bar loses it.
  let token = null;
  const params = new URLSearchParams(window.location.search);
  if (params.has("token")) {
    token = params.get("token");
    params.delete("token");
    const rest = params.toString();
    window.history.replaceState(null, "", window.location.pathname + (rest ? "?" + rest : "") + window.location.hash);
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) node.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function clock(ms) {
    if (!ms) return "-";
    const d = new Date(ms);
    const pad = (n, w) => String(n).padStart(w || 2, "0");
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + "." + pad(d.getMilliseconds(), 3);
  }

  function span(ms) {
    if (ms === null || ms === undefined) return "-";
    if (ms < 1000) return ms + " ms";
    if (ms < 120000) return (ms / 1000).toFixed(1) + " s";
    if (ms < 7200000) return (ms / 60000).toFixed(1) + " min";
    return (ms / 3600000).toFixed(1) + " h";
  }

  function table(cls, headers, rows) {
    const head = el("tr", {}, ...headers.map((h) => el("th", { class: h.num ? "num" : null }, h.text || h)));
    return el("table", { class: cls }, el("thead", {}, head), el("tbody", {}, ...rows));
  }

  function cell(text, cls) {
    return el("td", { class: cls || null }, text === null || text === undefined || text === "" ? "-" : text);
  }

  // Steps per second as a line, with its latest and largest values.
  function rateChart(points) {
    const w = 360, h = 70, pad = 4;
    const box = el("div", { class: "chart steps-chart" });
    const last = points.length ? points[points.length - 1][1] : null;
    const top = points.reduce((m, p) => Math.max(m, p[1]), 0);
    box.appendChild(el("div", { class: "label" }, "steps/s: " + (last === null ? "no samples yet" : last.toFixed(1)) + (points.length ? " (max " + top.toFixed(1) + ")" : "")));
    const s = svg("svg", { width: w, height: h, viewBox: "0 0 " + w + " " + h, role: "img" });
    s.appendChild(svg("rect", { x: 0, y: 0, width: w, height: h, fill: "#fcfcfc", stroke: "#eee" }));
    if (points.length >= 2) {
      const t0 = points[0][0], t1 = points[points.length - 1][0];
      const x = (t) => pad + ((t - t0) / Math.max(1, t1 - t0)) * (w - 2 * pad);
      const y = (v) => h - pad - (v / Math.max(top * 1.15, 1e-9)) * (h - 2 * pad);
      const line = points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ");
      s.appendChild(svg("polyline", { points: line, fill: "none", stroke: "#1565c0", "stroke-width": 1.5 }));
    }
    box.appendChild(s);
    return box;
  }

  // Generations as green bars, each revocation to re-formation as a red one.
  function timelineChart(job, now) {
    const w = 520, h = 70, pad = 4;
    const box = el("div", { class: "chart recovery-chart" });
    const spans = [], gaps = [];
    for (const f of job.failures) {
      spans.push({ from: f.formed_at_ms, to: f.revoked_at_ms, color: "#66bb6a", label: "g" + f.generation });
      gaps.push({ from: f.revoked_at_ms, to: f.reformed_at_ms || now, color: "#e53935", label: "" });
    }
    const g = job.generation;
    if (g && !g.revoked_at_ms) spans.push({ from: g.formed_at_ms, to: now, color: "#66bb6a", label: "g" + g.number });
    // Re-formations last, so that however short they are, they are drawn over the generations.
    spans.push(...gaps);
    const total = job.failures.reduce((a, f) => a + f.cost_ms, 0);
    box.appendChild(el("div", { class: "label" }, "recovery timeline: " + job.failures.length + " failure(s), " + span(total) + " re-forming"));
    const s = svg("svg", { width: w, height: h, viewBox: "0 0 " + w + " " + h, role: "img" });
    s.appendChild(svg("rect", { x: 0, y: 0, width: w, height: h, fill: "#fcfcfc", stroke: "#eee" }));
    if (spans.length) {
      const t0 = Math.min(...spans.map((p) => p.from)), t1 = Math.max(now, ...spans.map((p) => p.to));
      const x = (t) => pad + ((t - t0) / Math.max(1, t1 - t0)) * (w - 2 * pad);
      for (const p of spans) {
        const x0 = x(p.from), x1 = Math.max(x(p.to), x0 + 4);
        const r = svg("rect", { x: x0.toFixed(1), y: 22, width: (x1 - x0).toFixed(1), height: 22, fill: p.color });
        const title = svg("title", {});
        title.textContent = (p.label || "re-forming") + ": " + clock(p.from) + " to " + clock(p.to) + " (" + span(p.to - p.from) + ")";
        r.appendChild(title);
        s.appendChild(r);
        if (p.label && x1 - x0 > 18) {
          const t = svg("text", { x: (x0 + 3).toFixed(1), y: 16, "font-size": 11, fill: "#333" });
          t.textContent = p.label;
          s.appendChild(t);
        }
      }
      const t = svg("text", { x: pad, y: h - 6, "font-size": 10, fill: "#777" });
      t.textContent = clock(t0) + " \u2192 " + clock(t1);
      s.appendChild(t);
    }
    box.appendChild(s);
    return box;
  }

  function cause(c) {
    if (!c) return "(no longer remembered)";
    let text = "rank " + (c.rank === null ? "?" : c.rank) + ", worker " + (c.worker_id || "?") + ", host " + (c.host || "?") + ": " + c.reason + " (reported by " + c.reported_by + ")";
    if (c.domain) text += "; whole domain " + c.domain + " lost (ranks " + c.lost_ranks.join(", ") + ")";
    return text;
  }

  function drawJob(job, now) {
    const section = el("section", { class: "job", "data-job": job.job, "data-state": job.state });
    const g = job.generation;
    section.appendChild(el("h2", {}, "job " + job.job, el("span", { class: "badge " + job.state }, job.state)));
    const m = job.members;
    section.appendChild(el("div", { class: "facts" },
      el("span", {}, el("b", {}, "generation "), g ? g.number + " (" + g.size + " ranks, formed " + span(now - g.formed_at_ms) + " ago)" : "none yet"),
      el("span", {}, el("b", {}, "members "), m.total + " on " + m.hosts + " hosts: " + m.ranked + " ranked, " + m.waiting + " waiting, " + m.control_closed + " closed, " + m.stragglers + " stragglers"),
      el("span", {}, el("b", {}, "step "), "min " + job.step.min + ", median " + job.step.median + ", max " + job.step.max),
      el("span", {}, el("b", {}, "heartbeat age "), "median " + span(job.heartbeat_age_ms.median) + ", max " + span(job.heartbeat_age_ms.max))));
    if (job.ended) section.appendChild(el("p", { class: "ended" }, "ended: " + job.ended.outcome + ": " + job.ended.reason));
    if (job.digest_mismatches) section.appendChild(el("p", { class: "error" }, job.digest_mismatches + " step(s) committed with different state: see cohort-coordinator status"));
    section.appendChild(el("div", { class: "charts" }, rateChart(job.steps_per_second), timelineChart(job, now)));

    section.appendChild(el("h3", {}, "Failures (" + job.failures.length + ")"));
    if (job.failures.length) {
      const rows = job.failures.map((f) => el("tr", { class: "failure" + (f.reformed_at_ms ? "" : " ongoing"), "data-generation": f.generation, "data-worker": f.cause ? f.cause.worker_id : "" },
        cell(f.generation, "num"),
        cell(f.cause && f.cause.rank !== null ? f.cause.rank : "?", "num"),
        cell(f.cause ? f.cause.worker_id : ""),
        cell(f.cause ? f.cause.host : ""),
        cell(cause(f.cause), "cause"),
        cell(clock(f.revoked_at_ms)),
        cell(f.reformed_at_ms ? clock(f.reformed_at_ms) + " (" + f.size + " \u2192 " + f.reformed_size + " ranks)" : "re-forming\u2026"),
        cell(span(f.cost_ms), "num")));
      section.appendChild(table("failures", [{ text: "gen", num: true }, { text: "rank", num: true }, "worker", "host", "root cause", "detected & revoked", "re-formed", { text: "cost", num: true }], rows));
    } else {
      section.appendChild(el("p", { class: "muted" }, "none remembered"));
    }

    section.appendChild(el("h3", {}, "Outliers (" + job.outliers_total + (job.outliers_total > job.outliers.length ? ", first " + job.outliers.length + " shown" : "") + ")"));
    if (job.outliers.length) {
      const rows = job.outliers.map((o) => el("tr", { class: "outlier" },
        el("td", { class: "kind " + o.kind }, o.kind), cell(o.rank, "num"), cell(o.worker_id), cell(o.host), cell(o.why)));
      section.appendChild(el("div", { class: "scroll" }, table("outliers", ["kind", { text: "rank", num: true }, "worker", "host", "why"], rows)));
    } else {
      section.appendChild(el("p", { class: "muted" }, "none"));
    }

    section.appendChild(el("h3", {}, "Hosts (" + m.hosts + ")"));
    const hostRows = job.hosts.map((h) => el("tr", { class: "host" },
      cell(h.host), cell(h.members, "num"), cell(h.ranked, "num"), cell(h.waiting, "num"), cell(h.control_closed, "num"), cell(h.stragglers, "num"), cell(h.outliers, "num")));
    if (job.hosts_hidden.hosts) {
      hostRows.push(el("tr", { class: "host hidden" }, el("td", { colspan: 7, class: "muted" },
        job.hosts_hidden.hosts + " more hosts with " + job.hosts_hidden.members + " members, nothing to report")));
    }
    section.appendChild(el("div", { class: "scroll" }, table("hosts", ["host", { text: "members", num: true }, { text: "ranked", num: true }, { text: "waiting", num: true }, { text: "closed", num: true }, { text: "stragglers", num: true }, { text: "outliers", num: true }], hostRows)));
    return section;
  }

  function draw(data) {
    const jobs = document.getElementById("jobs");
    const sections = data.jobs.map((j) => drawJob(j, data.now_ms));
    if (!sections.length) sections.push(el("p", { class: "muted" }, "no jobs"));
    jobs.replaceChildren(...sections);
    const more = data.jobs_total > data.jobs.length ? " (" + data.jobs.length + " of " + data.jobs_total + " jobs shown)" : "";
    document.getElementById("meta").textContent = "replica " + data.replica + ", leader " + (data.leader || "(none)") + ", updated " + clock(data.now_ms) + more;
    document.body.setAttribute("data-state", "loaded");
  }

  function showError(text) {
    const box = document.getElementById("error");
    box.textContent = text;
    box.hidden = !text;
  }

  async function poll() {
    try {
      const headers = token ? { Authorization: "Bearer " + token } : {};
      const response = await fetch("status.json", { headers: headers, cache: "no-store" });
      const body = await response.json().catch(() => ({ error: "HTTP " + response.status }));
      if (!response.ok) {
        showError("the coordinator answered " + response.status + ": " + (body.error || ""));
      } else {
        draw(body);
        showError("");
      }
    } catch (e) {
      showError("cannot reach the coordinator: " + e);
    }
    window.setTimeout(poll, POLL_MS);
  }

  poll();
})();
