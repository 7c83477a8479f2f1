// A small line chart on <canvas>: one or two series over time, the latest value written.

export function lineChart(canvas, { title, series, max, fmt = (v) => String(v) }) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 300, h = canvas.clientHeight || 150;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  const g = canvas.getContext('2d');
  g.scale(ratio, ratio);
  g.clearRect(0, 0, w, h);
  g.font = '12px system-ui, sans-serif';
  const pad = { l: 8, r: 8, t: 22, b: 16 };
  const pts = series.flatMap((s) => s.points);
  const first = series[0] && series[0].points;     // for tests and curious readers: what is drawn
  canvas.dataset.points = String(first ? first.length : 0);
  canvas.dataset.max = first && first.length ? String(Math.max(...first.map((p) => p.v))) : '';
  const t0 = Math.min(...pts.map((p) => p.t)), t1 = Math.max(...pts.map((p) => p.t));
  const top = Math.max(max || 0, ...pts.map((p) => p.v), 1e-9);
  const x = (t) => pad.l + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (w - pad.l - pad.r);
  const y = (v) => h - pad.b - (v / top) * (h - pad.t - pad.b);
  g.strokeStyle = '#e4e7ec';
  g.beginPath();
  g.moveTo(pad.l, h - pad.b); g.lineTo(w - pad.r, h - pad.b);
  g.moveTo(pad.l, pad.t); g.lineTo(w - pad.r, pad.t);
  g.stroke();
  g.fillStyle = '#1d2330';
  g.fillText(title, pad.l, 14);
  g.fillStyle = '#667085';
  g.fillText(`max ${fmt(top)}`, w - pad.r - g.measureText(`max ${fmt(top)}`).width, 14);
  if (!pts.length) {
    g.fillText('no samples yet', pad.l, h / 2);
    return;
  }
  let legend = pad.l;
  for (const s of series) {
    g.strokeStyle = s.color;
    g.lineWidth = 1.5;
    g.beginPath();
    s.points.forEach((p, i) => (i ? g.lineTo(x(p.t), y(p.v)) : g.moveTo(x(p.t), y(p.v))));
    g.stroke();
    const last = s.points[s.points.length - 1];
    const label = `${s.name} ${last ? fmt(last.v) : ''}`;
    g.fillStyle = s.color;
    g.fillText(label, legend, h - 3);
    legend += g.measureText(label).width + 12;
  }
}
