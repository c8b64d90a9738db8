-- The page resty.loom.status.page() serves at /loom/: one HTML document,
-- no build step; it polls /loom/status every 2 s and loads Chart.js from
-- /loom/chart.js. A Lua module, so every installer (make install, the
-- rock, the .deb) puts it where status.lua finds it.

-- luacheck: no max line length

return {
    _VERSION = "0.2.0",
    html = [==[
<!DOCTYPE html>
<!-- resty.loom.status dashboard: polls /loom/status every 2 s; Chart.js
     comes from the gateway (/loom/chart.js, Debian's libjs-chart.js). All
     data is written with textContent, never parsed as HTML. -->
<html lang="en">
<head>
<meta charset="utf-8">
<title>resty-loom</title>
<link rel="icon" href="data:,">
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; background: #f4f5f7;
       color: #222; }
header { background: #1d2b3a; color: #fff; padding: 8px 16px; }
header b { font-size: 16px; margin-right: 16px; }
#error { color: #ffb4b4; margin-left: 16px; }
main { display: grid; grid-template-columns: repeat(auto-fit,
       minmax(560px, 1fr)); grid-auto-flow: dense; gap: 12px;
       padding: 12px; }
section { overflow-x: auto; background: #fff; border-radius: 4px; padding: 8px 12px;
          box-shadow: 0 1px 2px rgba(0,0,0,.15); }
h2 { font-size: 14px; margin: 0 0 6px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: right; padding: 2px 6px;
         border-bottom: 1px solid #eee; white-space: nowrap; }
/* headings and the names in the first column wrap at spaces, figures do
   not; the 10-11 columns of Events and Offload take a whole row, and the
   smaller panels fill the rows between them (dense) */
th { white-space: normal; vertical-align: bottom; }
th:first-child, td:first-child { text-align: left; }
td:first-child { white-space: normal; }
#events, #offload { grid-column: 1 / -1; }
td.bad { color: #b00020; font-weight: bold; }
canvas { max-height: 160px; }
.stall { border-top: 1px solid #eee; padding: 4px 0; }
.stall pre { margin: 2px 0 0 12px; font-size: 11px; color: #444; }
</style>
</head>
<body>
<header><b>resty-loom</b><span id="summary">loading</span>
<span id="error"></span></header>
<main>
<section id="events"><h2>Events</h2>
<canvas id="events-chart"></canvas>
<table><thead><tr><th>worker</th><th>published/s</th><th>delivered/s</th>
<th>delivered</th><th>published</th><th>dropped</th><th>gaps</th>
<th>queue</th><th>inbox</th><th>lag p50</th><th>lag p99</th></tr></thead>
<tbody id="events-rows"></tbody></table></section>

<section id="timers"><h2>Timers
<a href="/loom/timers/flamegraph.svg">flame graph</a></h2>
<canvas id="timers-chart"></canvas>
<table><thead><tr><th>worker</th><th>timers</th><th>pending</th>
<th>runs/s</th><th>runs</th><th>errors</th><th>dropped</th>
<th>late p50</th><th>late p99</th><th>run p99</th></tr></thead>
<tbody id="timers-rows"></tbody></table></section>

<section id="offload"><h2>Offload</h2>
<table><thead><tr><th>worker / runtime</th><th>queued</th><th>running</th>
<th>peak</th><th>completed</th><th>rejected</th><th>timeouts</th>
<th>wait p99</th><th>call p50</th><th>call p99</th></tr></thead>
<tbody id="offload-rows"></tbody></table></section>

<section id="stalls"><h2>Event-loop stalls
<a href="/loom/blocking?format=svg" id="flamegraph">flame graph</a></h2>
<table><thead><tr><th>worker</th><th>stalls</th><th>loop p99</th>
<th>longest</th><th>reports lost</th></tr></thead>
<tbody id="stall-rows"></tbody></table>
<div id="stall-list"></div></section>

<section id="publish"><h2>Publish</h2>
<canvas id="publish-chart"></canvas>
<table><thead><tr><th>worker / publisher</th><th>sent/s</th><th>sent</th>
<th>buffered</th><th>failed</th><th>dropped</th><th>rejected</th>
<th>latency p99</th></tr></thead>
<tbody id="publish-rows"></tbody></table></section>
</main>
<script src="/loom/chart.js"></script>
<script>
"use strict";
var REFRESH_MS = 2000, POINTS = 60;
var COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
              "#8c564b", "#e377c2", "#17becf"];
var prev = null, charts = {};
window.loomUpdates = 0;

// the q-th quantile of a status histogram, interpolated in its bucket
function quantile(h, q) {
  if (!h || !h.count) return null;
  var rank = q * h.count, lo = 0, below = 0;
  for (var i = 0; i < h.le.length; i++) {
    if (h.buckets[i] >= rank) {
      var n = h.buckets[i] - below;
      return lo + (h.le[i] - lo) * (n ? (rank - below) / n : 1);
    }
    lo = h.le[i]; below = h.buckets[i];
  }
  return h.le[h.le.length - 1];
}

function secs(v) {
  if (v === null || v === undefined) return "-";
  if (v < 0.001) return (v * 1e6).toFixed(0) + " µs";
  if (v < 1) return (v * 1e3).toFixed(1) + " ms";
  return v.toFixed(2) + " s";
}

function num(v) {
  return v === undefined || v === null ? "-" : String(Math.round(v));
}

function rate(key, v, dt) {
  if (!prev || !(key in prev.values) || dt <= 0) return null;
  return Math.max(0, (v - prev.values[key]) / dt);
}

function row(tbody, cells, bad) {
  var tr = document.createElement("tr");
  cells.forEach(function (c, i) {
    var td = document.createElement("td");
    td.textContent = c === null ? "-" : c;
    if (bad && bad[i]) td.className = "bad";
    tr.appendChild(td);
  });
  tbody.appendChild(tr);
  return tr;
}

function clear(id) {
  var el = document.getElementById(id);
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

function chart(id, label) {
  if (charts[id]) return charts[id];
  charts[id] = new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets: [] },
    options: { animation: false, responsive: true,
               plugins: { title: { display: true, text: label } },
               scales: { y: { beginAtZero: true } } }
  });
  return charts[id];
}

function plot(id, label, time, series) {
  var c = chart(id, label);
  c.data.labels.push(time);
  if (c.data.labels.length > POINTS) c.data.labels.shift();
  Object.keys(series).forEach(function (name) {
    var ds = c.data.datasets.find(function (d) { return d.label === name; });
    if (!ds) {
      var color = COLORS[c.data.datasets.length % COLORS.length];
      ds = { label: name, data: [], pointRadius: 0, borderWidth: 1.5,
             borderColor: color, backgroundColor: color };
      c.data.datasets.push(ds);
    }
    ds.data.push(series[name]);
    while (ds.data.length > c.data.labels.length) ds.data.shift();
  });
  c.update();
}

function render(doc) {
  var now = doc.time, dt = prev ? now - prev.time : 0, values = {};
  var t = new Date(now * 1000).toLocaleTimeString();
  var up = doc.workers.filter(function (w) { return !w.error; }).length;
  document.getElementById("summary").textContent =
    "workers " + up + "/" + doc.workers.length + " answering · nginx " +
    doc.nginx.version + " · " + (doc.nginx.connections_active || 0) +
    " connections · " + t;

  var ev = clear("events-rows"), tm = clear("timers-rows"),
      of = clear("offload-rows"), st = clear("stall-rows"),
      pb = clear("publish-rows"), sl = clear("stall-list");
  var evRate = {}, late = {}, sent = {}, reports = [];

  doc.workers.forEach(function (w) {
    var id = String(w.id);
    if (w.error) {
      row(ev, ["worker " + id + ": " + w.error], [true]);
      return;
    }
    var e = w.events;
    if (e && !e.error) {
      values["ev" + id] = e.delivered_total;
      values["evp" + id] = e.published_total;
      var dr = rate("ev" + id, e.delivered_total, dt);
      evRate["worker " + id] = dr;
      var r = row(ev, ["worker " + id,
        num(rate("evp" + id, e.published_total, dt)), num(dr),
        num(e.delivered_total), num(e.published_total), num(e.dropped_total),
        num(e.gaps_total), num(e.queue_events), num(e.inbox_events),
        secs(quantile(e.delivery_seconds, 0.5)),
        secs(quantile(e.delivery_seconds, 0.99))],
        { 5: e.dropped_total > 0, 6: e.gaps_total > 0 });
      r.children[3].id = "events-delivered-" + id;
    }
    var tr = w.timers;
    if (tr && !tr.error) {
      values["tr" + id] = tr.runs_total;
      var lp = quantile(tr.lateness_seconds, 0.99);
      late["worker " + id] = lp === null ? null : lp * 1000;
      var r2 = row(tm, ["worker " + id, num(tr.timers), num(tr.pending),
        num(rate("tr" + id, tr.runs_total, dt)), num(tr.runs_total),
        num(tr.errors_total), num(tr.dropped_total),
        secs(quantile(tr.lateness_seconds, 0.5)), secs(lp),
        secs(quantile(tr.run_seconds, 0.99))],
        { 5: tr.errors_total > 0, 6: tr.dropped_total > 0 });
      r2.children[4].id = "timers-runs-" + id;
    }
    var o = w.offload;
    if (o && o.runtimes) {
      Object.keys(o.runtimes).sort().forEach(function (name) {
        var rt = o.runtimes[name], c = rt.call_seconds;
        var r3 = row(of, ["worker " + id + " / " + name, num(rt.queued),
          num(rt.running), num(rt.peak_queued), num(rt.completed_total),
          num(rt.rejected_total), num(rt.timeouts_total),
          secs(quantile(rt.queue_wait_seconds, 0.99)),
          secs(quantile(c, 0.5)), secs(quantile(c, 0.99))],
          { 5: rt.rejected_total > 0, 6: rt.timeouts_total > 0 });
        r3.children[4].id = "offload-completed-" + id;
      });
    }
    var wd = w.watchdog;
    if (wd && !wd.error) {
      var r4 = row(st, ["worker " + id, num(wd.stalls_total),
        secs(quantile(wd.iteration_seconds, 0.99)),
        secs(wd.max_iteration_seconds), num(wd.reports_dropped_total)],
        { 1: wd.stalls_total > 0 });
      r4.children[1].id = "stalls-" + id;
      (wd.reports || []).forEach(function (rep) {
        reports.push({ worker: id, rep: rep });
      });
    }
    var p = w.publish;
    if (p && p.publishers) {
      Object.keys(p.publishers).sort().forEach(function (name) {
        var pu = p.publishers[name], key = "pb" + id + name;
        values[key] = pu.sent_total;
        var sr = rate(key, pu.sent_total, dt);
        sent["worker " + id + " " + name] = sr;
        var r5 = row(pb, ["worker " + id + " / " + name, num(sr),
          num(pu.sent_total), num(pu.buffered_messages),
          num(pu.failed_total), num(pu.dropped_total),
          num(pu.rejected_total), secs(quantile(pu.latency_seconds, 0.99))],
          { 4: pu.failed_total > 0, 5: pu.dropped_total > 0 });
        r5.children[2].id = "publish-sent-" + id;
      });
    }
  });

  reports.sort(function (a, b) { return b.rep.time - a.rep.time; });
  reports.slice(0, 10).forEach(function (x) {
    var rep = x.rep, div = document.createElement("div");
    div.className = "stall";
    var what = rep.request ? rep.request.method + " " + rep.request.path
             : rep.timer ? "timer " + (rep.timer.name || rep.timer.callback
                                       || "") : "";
    div.textContent = new Date(rep.time * 1000).toLocaleTimeString() +
      " worker " + x.worker + ": " + secs(rep.duration_seconds) + " " +
      (rep.kind || "") + (rep.syscall ? " in " + rep.syscall : "") +
      " " + what;
    var pre = document.createElement("pre");
    pre.textContent = (rep.backtrace || []).map(function (f) {
      return (f.func || "?") + "  " + f.source + (f.line ? ":" + f.line : "");
    }).join("\n") || rep.backtrace_missing || "";
    div.appendChild(pre);
    sl.appendChild(div);
  });

  if (dt > 0) {
    plot("events-chart", "events delivered / s", t, evRate);
    plot("timers-chart", "timer lateness p99 (ms)", t, late);
    plot("publish-chart", "messages sent / s", t, sent);
  }
  prev = { time: now, values: values };
}

function refresh() {
  fetch("/loom/status").then(function (r) {
    if (!r.ok) throw new Error("status " + r.status);
    return r.json();
  }).then(function (doc) {
    render(doc);
    document.getElementById("error").textContent = "";
    window.loomUpdates++;
  }).catch(function (err) {
    document.getElementById("error").textContent = String(err);
  }).finally(function () {
    setTimeout(refresh, REFRESH_MS);
  });
}
refresh();
</script>
</body>
</html>
]==],
}
