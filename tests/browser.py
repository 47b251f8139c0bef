"""Open a chart page in headless Chromium and read back what the page itself checked.

No DevTools client: the page is copied with two scripts added, one first in <head> that records
every JavaScript error (uncaught errors, rejected promises, console.error), one at the end of
<body> that waits for Plotly, inspects every plot (traces, data points, drawn SVG marks), on a
page with sliders drags the first slider to another step with synthetic mouse events the way a
user would, and writes its findings as JSON into a <pre id="perfsim-test-result"> element.
`chromium --headless --dump-dom --virtual-time-budget=...` then prints the DOM with that element.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--run-all-compositor-stages-before-draw", "--disable-dev-shm-usage", "--no-first-run",
         "--hide-scrollbars", "--mute-audio", "--disable-extensions", "--allow-file-access-from-files")

HEAD_SCRIPT = """<script>
// Under --virtual-time-budget headless Chromium produces no animation frames after load, and
// Plotly runs a slider step's method in requestAnimationFrame: run frames on timers instead.
window.requestAnimationFrame = function (cb) { return setTimeout(function () { cb(performance.now()); }, 16); };
window.cancelAnimationFrame = function (id) { clearTimeout(id); };
window.__perfsimErrors = [];
window.addEventListener('error', function (e) {
  window.__perfsimErrors.push('error: ' + (e.message || (e.target && e.target.src) || String(e)));
}, true);
window.addEventListener('unhandledrejection', function (e) {
  window.__perfsimErrors.push('unhandled rejection: ' + (e.reason && (e.reason.stack || e.reason)));
});
(function () {
  var original = console.error;
  console.error = function () {
    window.__perfsimErrors.push('console.error: ' + Array.prototype.join.call(arguments, ' '));
    return original.apply(console, arguments);
  };
})();
</script>"""

TAIL_SCRIPT = r"""<script>
(function () {
  var out = {errors: null, plots: [], slider: null, plotly: typeof Plotly !== 'undefined' ? Plotly.version : null};
  function text(el) { return el ? el.textContent : null; }
  function points(trace) {
    // Non-empty values of a trace as plotly.js resolved it (_fullData: typed arrays decoded).
    var n = 0;
    ['x', 'y', 'z', 'values'].forEach(function (k) {
      var v = trace[k];
      if (!v || v.length === undefined || typeof v === 'string') { return; }
      var count = 0;
      Array.prototype.forEach.call(v, function (row) {
        if (row !== null && typeof row === 'object' && row.length !== undefined) {
          Array.prototype.forEach.call(row, function (x) { if (x !== null && x !== undefined) { count++; } });
        } else if (row !== null && row !== undefined) { count++; }
      });
      n = Math.max(n, count);
    });
    return n;
  }
  function inspect() {
    document.querySelectorAll('.js-plotly-plot').forEach(function (gd) {
      var layout = gd.layout || {};
      var title = layout.title && (layout.title.text || layout.title);
      var axes = Object.keys(layout).filter(function (k) { return /^[xy]axis\d*$/.test(k); }).map(function (k) {
        var t = layout[k].title; return {axis: k, title: t && (t.text || t)};
      });
      out.plots.push({
        id: gd.id, traces: (gd.data || []).length,
        points: (gd._fullData || []).reduce(function (n, t) { return n + points(t); }, 0),
        marks: gd.querySelectorAll('.scatterlayer .point, .scatterlayer path.js-line, .barlayer path, ' +
                                   '.heatmaplayer image, .shapelayer path').length,
        title: title || null, axes: axes, sliders: (layout.sliders || []).length,
        width: gd.getBoundingClientRect().width, height: gd.getBoundingClientRect().height,
        boxes: boxes(gd)
      });
    });
  }
  function box(el) {
    var r = el.getBoundingClientRect();
    return {text: text(el), left: r.left, right: r.right, top: r.top + window.scrollY, bottom: r.bottom + window.scrollY};
  }
  function boxes(gd) {
    // Where the plot, its title, its axis titles and its x tick labels are drawn (page coordinates):
    // a title cut off by the plot's edge or drawn over another shows here.
    var all = function (sel) { return Array.prototype.map.call(gd.querySelectorAll(sel), box); };
    return {plot: box(gd), title: all('.g-gtitle text')[0] || null,
            axisTitles: all('.g-xtitle text, .g-ytitle text, [class^="g-x"][class$="title"] text, [class^="g-y"][class$="title"] text'),
            xticks: all('.xtick text, .x2tick text')};
  }
  function annotationTexts(gd) {
    return Array.prototype.map.call(gd.querySelectorAll('.annotation-text'), text).join(' | ');
  }
  function sliderState(gd) {
    // The "current value" line of each slider: its text.slider-label outside the step labels.
    var current = Array.prototype.map.call(gd.querySelectorAll('.slider-group'), function (g) {
      return text(Array.prototype.find.call(g.querySelectorAll('text.slider-label'), function (e) {
        return !e.closest('.slider-label-group');
      }));
    });
    return {current: current,
            active: gd.layout.sliders.map(function (s) { return s.active; }), notes: annotationTexts(gd),
            data: JSON.stringify((gd.data || []).map(function (t) { return [t.x, t.y]; }))};
  }
  function drag(gd, index, target) {
    // A user's click on slider `index` at the label of step `target`, as plotly's d3 handlers see it.
    var group = gd.querySelectorAll('.slider-group')[index];
    var label = group.querySelectorAll('.slider-label-group')[target].getBoundingClientRect();
    var rail = group.querySelector('.slider-rail-touch-rect');
    var railBox = rail.getBoundingClientRect();
    var options = {bubbles: true, cancelable: true, view: window, button: 0, buttons: 1,
                   clientX: label.left + label.width / 2, clientY: railBox.top + railBox.height / 2};
    rail.dispatchEvent(new MouseEvent('mousedown', options));
    window.dispatchEvent(new MouseEvent('mouseup', options));
  }
  function moveSlider(done) {
    var gd = Array.prototype.find.call(document.querySelectorAll('.js-plotly-plot'), function (g) {
      return g.layout && g.layout.sliders && g.layout.sliders.length;
    });
    if (!gd) { done(); return; }
    var events = [];
    gd.on('plotly_sliderchange', function (e) { events.push('sliderchange ' + e.step.label); });
    gd.on('plotly_update', function () { events.push('update'); });
    var moves = [[0, gd.layout.sliders[0].steps.length - 2]];
    if (gd.layout.sliders.length > 1) { moves.push([1, 1]); }
    out.slider = {before: sliderState(gd), moves: []};
    var n = 0;
    function next() {
      if (n >= moves.length) { out.slider.events = events; done(); return; }
      var move = moves[n++];
      drag(gd, move[0], move[1]);
      setTimeout(function () {
        out.slider.moves.push({slider: move[0], step: move[1], label: gd.layout.sliders[move[0]].steps[move[1]].label,
                               after: sliderState(gd)});
        next();
      }, 1000);
    }
    next();
  }
  function finish() {
    out.errors = window.__perfsimErrors;
    var pre = document.createElement('pre');
    pre.id = 'perfsim-test-result';
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  }
  setTimeout(function () {
    try { inspect(); } catch (e) { window.__perfsimErrors.push('inspect: ' + e); }
    try { moveSlider(finish); } catch (e) { window.__perfsimErrors.push('slider: ' + e); finish(); }
  }, 1500);
})();
</script>"""


def instrument(page: str, copy: str) -> None:
    """Write `page` with the two scripts added to `copy`."""
    with open(page, encoding="utf-8") as fh:
        text = fh.read()
    head = text.index("<head>") + len("<head>")
    text = text[:head] + HEAD_SCRIPT + text[head:]
    tail = text.rindex("</body>")
    text = text[:tail] + TAIL_SCRIPT + text[tail:]
    with open(copy, "w", encoding="utf-8") as fh:
        fh.write(text)


def check_pages(pages: list, workdir: str, budget_ms: int = 8000, timeout: float = 120, parallel: int = 4) -> dict:
    """page path -> the findings its injected script wrote (None if it wrote nothing); up to
    `parallel` Chromium processes at once."""
    commands = {}
    for n, page in enumerate(pages):
        copy = os.path.join(workdir, f"checked-{n}-{os.path.basename(page)}")
        instrument(page, copy)
        profile = os.path.join(workdir, f"profile-{n}")
        commands[page] = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--window-size=1500,1100",
                          f"--virtual-time-budget={budget_ms}", "--dump-dom", "file://" + os.path.abspath(copy)]
    found, waiting, running = {}, list(commands), {}
    while waiting or running:
        while waiting and len(running) < parallel:
            page = waiting.pop(0)
            running[page] = subprocess.Popen(commands[page], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        page = next(iter(running))
        proc = running.pop(page)
        try:
            dom, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            dom, _ = proc.communicate()
        match = re.search(r'<pre id="perfsim-test-result">(.*?)</pre>', dom, re.S)
        found[page] = json.loads(_unescape(match.group(1))) if match else None
    return found


def screenshot(page: str, png: str, workdir: str, size=(1500, 1100), timeout: float = 90) -> None:
    profile = os.path.join(workdir, "profile-shot")
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                    "--virtual-time-budget=5000", f"--screenshot={png}", "file://" + os.path.abspath(page)],
                   capture_output=True, timeout=timeout, check=False)


def _unescape(text: str) -> str:
    import html

    return html.unescape(text)
