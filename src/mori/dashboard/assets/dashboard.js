// MORI dashboard: renders frames from the server (live: polled from stateUrl; timeline:
// embedded). Charts arrive as SVG drawn by the server; every other text is escaped here.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("mori-data").textContent);
  var $ = function (id) { return document.getElementById(id); };
  var ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  function esc(s) { return String(s).replace(/[&<>"']/g, function (c) { return ESC[c]; }); }
  function dash(v) { return v === null || v === undefined ? "–" : v; }
  function int(v) { return v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US"); }
  function secs(v) {
    if (v === null || v === undefined) return "–";
    if (v < 60) return v.toFixed(1) + " s";
    if (v < 3600) return (v / 60).toFixed(1) + " min";
    return (v / 3600).toFixed(2) + " h";
  }
  var filterText = "";
  var current = null;

  function card(label, value) {
    return '<div class="card"><b>' + esc(value) + "</b><span>" + esc(label) + "</span></div>";
  }

  function renderSummary(f) {
    var s = f.summary;
    $("summary").innerHTML = [
      card("programs", int(s.programs)), card("reasoning", int(s.reasoning)),
      card("acting", int(s.acting)), card("held", int(s.held)),
      card("on GPU", int(s.tier_gpu)), card("on CPU", int(s.tier_cpu)),
      card("no tier", int(s.tier_none)),
      card("output tok/s", s.tokens_per_s === null ? "–" : s.tokens_per_s.toFixed(1)),
      card("TTFT p50", s.ttft_p50_s === null ? "–" : s.ttft_p50_s.toFixed(2) + " s"),
      card("TTFT p99", s.ttft_p99_s === null ? "–" : s.ttft_p99_s.toFixed(2) + " s"),
      card(data.mode === "live" ? "policy time" : "simulated time", secs(f.t))
    ].join("");
  }

  function bar(label, used, cap, cls, n) {
    var pct = cap > 0 ? Math.min(100, 100 * used / cap) : 0;
    return '<div class="bar"><span>' + esc(label) + '</span><div class="track"><div class="fill ' +
      cls + '" style="width:' + pct.toFixed(1) + '%"></div></div><span>' + int(used) + " / " +
      int(cap) + " (" + n + " prog)</span></div>";
  }

  function renderTiers(f) {
    var out = [];
    f.tiers.forEach(function (r) {
      out.push(bar("r" + r[0] + " GPU", r[1], r[2], "gpu", r[5]));
      if (r[4] > 0) out.push(bar("r" + r[0] + " CPU", r[3], r[4], "cpu", r[6]));
      (f.prices || []).forEach(function (p) {
        if (p[0] !== r[0] || p[2] === null) return;
        out.push('<div class="price">r' + p[0] + " engine: recompute " + p[2] + " ms / 1k tok" +
          (p[3] === null ? "" : " · reload " + p[3] + " ms + " + p[4] + " ms / 1k tok") +
          " (" + int(p[1]) + " stretches)</div>");
      });
    });
    $("tiers").innerHTML = out.join("");
  }

  function renderPrograms(f) {
    var rows = [], q = filterText;
    f.programs.forEach(function (p, i) {
      if (q && (String(p[0]) + " " + (p[8] || "")).toLowerCase().indexOf(q) < 0) return;
      rows.push("<tr><td>" + (i + 1) + '</td><td class="id" title="' + esc(p[0]) + '">' + esc(p[0]) +
        "</td><td>" + p[1].toFixed(3) + '</td><td class="st-' + esc(p[2]) + '">' + esc(p[2]) +
        '</td><td class="t-' + esc(p[3]) + '">' + esc(p[3]) + "</td><td>" + dash(p[4]) +
        "</td><td>" + int(p[5]) + "</td><td>" + secs(p[6]) + "</td><td>" + int(p[7]) +
        "</td><td>" + esc(p[8] || "–") + '</td><td class="id" title="' + esc(p[9] || "") + '">' +
        esc(p[9] || "–") + "</td></tr>");
    });
    $("programs").tBodies[0].innerHTML = rows.join("");
  }

  function renderHeld(f) {
    $("held").tBodies[0].innerHTML = f.held.map(function (g) {
      return '<tr><td class="id" title="' + esc(g[0]) + '">' + esc(g[0]) + "</td><td>" + secs(g[1]) +
        '</td><td class="t-' + esc(g[2]) + '">' + esc(g[2]) + "</td><td>" + dash(g[3]) +
        "</td><td>" + int(g[4]) + "</td></tr>";
    }).join("") || '<tr><td colspan="5" class="hint">nothing held</td></tr>';
  }

  function renderDecisions(f) {
    $("decisions").tBodies[0].innerHTML = f.decisions.map(function (d) {
      return "<tr><td>" + secs(d[0]) + "</td><td>" + esc(d[1]) + (d[4] ? " " + esc(d[4]) : "") +
        '</td><td class="id" title="' + esc(d[2]) + '">' + esc(d[2]) + "</td><td>" + dash(d[3]) +
        '</td><td class="why">' + esc(d[5]) + "</td></tr>";
    }).join("") || '<tr><td colspan="5" class="hint">none yet</td></tr>';
  }

  function renderCharts(charts) {
    Object.keys(charts).forEach(function (k) {
      var box = $("chart-" + k + "-box");
      if (box) box.innerHTML = charts[k];  // SVG drawn and escaped by the server
    });
  }

  function render(f) {
    current = f;
    renderSummary(f);
    $("spectrum").innerHTML = f.spectrum;  // SVG drawn and escaped by the server
    renderTiers(f);
    renderPrograms(f);
    renderHeld(f);
    renderDecisions(f);
    document.body.dataset.frameTime = String(f.t);
  }

  $("filter").addEventListener("input", function (e) {
    filterText = e.target.value.toLowerCase();
    if (current) renderPrograms(current);
  });

  function setConn(text, bad) {
    var c = $("conn");
    c.textContent = text;
    c.className = bad ? "conn bad" : "conn";
  }

  // -- live: poll the state endpoint with the admin key, if any -------------------------
  function live() {
    var key = sessionStorage.getItem("mori-admin-key") || "";
    var m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
    if (m) {  // a key in the fragment (never sent to the server): keep it, clear the address
      key = decodeURIComponent(m[1]);
      sessionStorage.setItem("mori-admin-key", key);
      history.replaceState(null, "", location.pathname + location.search);
    }
    var timer = null, updates = 0;
    function schedule(ms) { clearTimeout(timer); timer = setTimeout(poll, ms); }
    function askKey(msg) {
      $("keymsg").textContent = msg;
      $("keybox").hidden = false;
      $("main").hidden = true;
      setConn("admin key needed", true);
    }
    function poll() {
      var headers = key ? { Authorization: "Bearer " + key } : {};
      fetch(data.stateUrl, { headers: headers, cache: "no-store" }).then(function (r) {
        return r.json().then(function (body) { return { status: r.status, body: body }; },
          function () { return { status: r.status, body: null }; });
      }).then(function (res) {
        if (res.status === 401 || res.status === 403) {
          var msg = res.body && res.body.error ? res.body.error.message : "refused";
          askKey((key ? "That key was refused: " : "This dashboard needs an admin key: ") + msg);
          return;
        }
        if (res.status !== 200 || !res.body) {
          setConn("the gateway answered " + res.status + "; retrying", true);
          schedule(2000);
          return;
        }
        $("keybox").hidden = true;
        $("main").hidden = false;
        render(res.body.frame);
        renderCharts(res.body.charts);
        updates += 1;
        document.body.dataset.updates = String(updates);
        if (updates === 1) document.body.dataset.firstRenderMs = performance.now().toFixed(0);
        setConn("live · " + res.body.meta.replicas + " replica(s) · updated " +
                new Date().toLocaleTimeString(), false);
        schedule(data.pollMs);
      }).catch(function () {
        setConn("cannot reach the gateway; retrying", true);
        schedule(2000);
      });
    }
    $("keybox").addEventListener("submit", function (e) {
      e.preventDefault();
      key = $("keyinput").value.trim();
      sessionStorage.setItem("mori-admin-key", key);
      poll();
    });
    poll();
  }

  // -- timeline: frames embedded in the file, a slider over the run ---------------------
  function timeline() {
    var frames = data.frames, slider = $("slider"), playing = null;
    $("timebar").hidden = false;
    renderCharts(data.charts);
    slider.max = String(frames.length - 1);
    function show(i) {
      var f = frames[i];
      render(f);
      $("clock").textContent = secs(f.t) + " / " + secs(data.duration);
      var cursors = document.querySelectorAll("svg line.cursor");
      Array.prototype.forEach.call(cursors, function (c) {
        var x0 = +c.dataset.x0, x1 = +c.dataset.x1, left = +c.dataset.left, w = +c.dataset.width;
        var x = left + (f.t - x0) / ((x1 - x0) || 1) * w;
        c.setAttribute("x1", x.toFixed(1));
        c.setAttribute("x2", x.toFixed(1));
      });
    }
    slider.addEventListener("input", function () { show(+slider.value); });
    $("play").addEventListener("click", function () {
      if (playing) { clearInterval(playing); playing = null; $("play").textContent = "▶"; return; }
      $("play").textContent = "❚❚";
      playing = setInterval(function () {
        var i = +slider.value + 1;
        if (i >= frames.length) { clearInterval(playing); playing = null; $("play").textContent = "▶"; return; }
        slider.value = String(i);
        show(i);
      }, 200);
    });
    setConn(data.run, false);
    show(frames.length - 1);
    slider.value = String(frames.length - 1);
  }

  if (data.mode === "timeline") timeline(); else live();
})();
