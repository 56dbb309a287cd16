// A line chart of one metric against the step, drawn as SVG by hand (no library, works offline).
// new LossChart(element).set({points, snapshots, resumes}); .add(points); the curve redraws once a frame.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// Round tick values (1, 2, 2.5 or 5 times a power of ten) covering low..high, as daemon/cli/plot.py does.
function niceTicks(low, high, count) {
  if (!(high > low)) return [low];
  const raw = (high - low) / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const first = Math.ceil(low / step - 1e-9) * step;
  const ticks = [];
  for (let t = first; t <= high + step * 1e-9; t = first + step * ticks.length) {
    ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
  }
  return ticks;
}

function tickText(v) {
  return Number(v.toPrecision(4)).toString();
}

class LossChart {
  constructor(element, metric) {
    this.element = element;
    this.metric = metric || "loss";
    this.points = [];
    this.snapshots = [];
    this.resumes = [];
    this.pending = false;
    this.width = 900;
    this.height = 360;
    this.margin = { left: 64, right: 16, top: 16, bottom: 36 };
  }

  set(data) {
    this.points = (data.points || []).slice();
    this.snapshots = (data.snapshots || []).slice();
    this.resumes = (data.resumes || []).slice();
    this.redraw();
  }

  add(points) {
    for (const p of points) this.points.push(p);
    this.redraw();
  }

  markSnapshot(step) {
    if (this.snapshots.some((s) => s[0] === step)) return;
    const before = this.points.filter((p) => p[0] <= step);
    if (before.length) this.snapshots.push([step, before[before.length - 1][1]]);
    this.redraw();
  }

  redraw() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  draw() {
    const { width, height, margin } = this;
    const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `${this.metric} by step` });
    svg.appendChild(svgEl("rect", { width, height, fill: "white" }));
    const plotW = width - margin.left - margin.right;
    const plotH = height - margin.top - margin.bottom;
    if (!this.points.length) {
      svg.appendChild(svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, `no ${this.metric} logged yet`));
      this.element.replaceChildren(svg);
      return;
    }
    // Loops, not Math.min(...array): a long run has more points than a call may take arguments.
    let xLow = Infinity, xHigh = -Infinity, yLow = Infinity, yHigh = -Infinity;
    for (const [s, v] of this.points) {
      if (s < xLow) xLow = s;
      if (s > xHigh) xHigh = s;
      if (v < yLow) yLow = v;
      if (v > yHigh) yHigh = v;
    }
    if (xHigh === xLow) { xLow -= 1; xHigh += 1; }
    const pad = (yHigh - yLow) * 0.05 || Math.abs(yHigh) * 0.05 || 1;
    yLow -= pad; yHigh += pad;
    const px = (s) => margin.left + ((s - xLow) / (xHigh - xLow)) * plotW;
    const py = (v) => margin.top + ((yHigh - v) / (yHigh - yLow)) * plotH;

    const grid = svgEl("g", { stroke: "#e5e5e5" });
    for (const t of niceTicks(yLow, yHigh, 6)) {
      grid.appendChild(svgEl("line", { x1: margin.left, x2: margin.left + plotW, y1: py(t), y2: py(t) }));
      grid.appendChild(svgEl("text", { x: margin.left - 6, y: py(t) + 4, "text-anchor": "end", stroke: "none" }, tickText(t)));
    }
    for (const t of niceTicks(xLow, xHigh, 8)) {
      grid.appendChild(svgEl("line", { x1: px(t), x2: px(t), y1: margin.top, y2: margin.top + plotH }));
      grid.appendChild(svgEl("text", { x: px(t), y: margin.top + plotH + 16, "text-anchor": "middle", stroke: "none" }, tickText(t)));
    }
    svg.appendChild(grid);
    svg.appendChild(svgEl("rect", { x: margin.left, y: margin.top, width: plotW, height: plotH, fill: "none", stroke: "#999" }));
    svg.appendChild(svgEl("text", { x: margin.left + plotW / 2, y: height - 4, "text-anchor": "middle" }, "step"));
    for (const [s] of this.resumes) {
      svg.appendChild(svgEl("line", { class: "resume-line", x1: px(s), x2: px(s), y1: margin.top, y2: margin.top + plotH, stroke: "#1f77b4", "stroke-dasharray": "4 3", opacity: 0.6 }));
    }
    const line = this.points.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
    svg.appendChild(svgEl("polyline", { class: "curve", points: line, fill: "none", stroke: "#1f77b4", "stroke-width": 1.6, "data-count": this.points.length }));
    for (const [s, v] of this.snapshots) {
      const r = svgEl("rect", { class: "snapshot", x: px(s) - 5, y: py(v) - 5, width: 10, height: 10, fill: "white", stroke: "#2ca02c", "stroke-width": 2 });
      r.appendChild(svgEl("title", {}, `snapshot at step ${s}`));
      svg.appendChild(r);
    }
    for (const [s, v] of this.resumes) {
      const x = px(s), y = py(v);
      const t = svgEl("polygon", { class: "resume", points: `${x - 5},${y - 6} ${x + 6},${y} ${x - 5},${y + 6}`, fill: "#1f77b4" });
      t.appendChild(svgEl("title", {}, `resumed at step ${s}`));
      svg.appendChild(t);
    }
    this.element.replaceChildren(svg);
  }
}

window.LossChart = LossChart;
