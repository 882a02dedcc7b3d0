"""The live page ``GET /dashboard`` answers on a replica and on the gateway: one self-contained
HTML document (inline CSS and JavaScript, no external asset, no build step; works offline).

It holds no data: every ``POLL_INTERVAL_S`` it fetches ``dashboard/data`` (``kvhive.core.dashboard_data``'s
shape) from the page's own origin and path (never from a URL carrying ``user:key@``, which fetch
refuses), so the browser sends the HTTP Basic credentials it opened the page with; the page itself
handles no key. It renders cards, series and tables generically, and marks each with a stable
attribute a browser test reads: ``data-card`` (with ``data-value``, the raw number), ``data-series``
(with ``data-points``), ``data-table`` (rows hold ``td[data-col]``, with ``data-value`` on numbers),
and ``#status[data-state]`` ("ok", "auth", "error").
"""

from __future__ import annotations

from kvhive.core.dashboard_data import POLL_INTERVAL_S

_STYLE = """
body{font:14px system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{display:flex;gap:1em;align-items:center;padding:.6em 1em;background:#1d2330;color:#fff}
header h1{font-size:1.1em;margin:0;flex:1}
#status{font-size:.85em}#status[data-state=error],#status[data-state=auth]{color:#ffb4a8}
main{padding:1em}
#cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(11em,1fr));gap:.6em}
.card{background:#fff;border-radius:6px;padding:.6em .8em;box-shadow:0 1px 2px #0002}
.card .label{font-size:.8em;color:#5a6275}.card .value{font-size:1.5em;font-weight:600}
#series{display:grid;grid-template-columns:repeat(auto-fill,minmax(20em,1fr));gap:.6em;margin-top:1em}
.chart{background:#fff;border-radius:6px;padding:.5em;box-shadow:0 1px 2px #0002}
.chart svg{width:100%;height:90px}.chart polyline{fill:none;stroke:#2f6fdf;stroke-width:1.5}
.chart .label{font-size:.8em;color:#5a6275}
section.table{background:#fff;border-radius:6px;margin-top:1em;padding:.5em;box-shadow:0 1px 2px #0002;overflow-x:auto}
section.table h2{font-size:1em;margin:.2em .3em .5em}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.2em .5em;border-bottom:1px solid #e3e6ec}
td.num{text-align:right;font-variant-numeric:tabular-nums}
"""

_SCRIPT = """
const POLL_MS = %(poll_ms)d;
// Next to the page, without the user:key@ the page may have been opened with (fetch refuses
// such a URL); the browser re-sends the page's Basic credentials to its own origin.
const DATA_URL = new URL('dashboard/data', location.origin + location.pathname);

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) { node.setAttribute(name, value); }
  if (text !== undefined) { node.textContent = text; }
  return node;
}

function formatValue(value, unit) {
  if (value === null || value === undefined) { return '-'; }
  if (typeof value !== 'number') { return String(value); }
  if (unit === 'fraction') { return (value * 100).toFixed(1) + ' %%'; }
  if (unit === 'bytes') {
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB']; let v = value, i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : v) + ' ' + units[i];
  }
  const text = Number.isInteger(value) ? value.toLocaleString('en') : value.toFixed(3);
  return unit && unit !== 'count' ? text + ' ' + unit : text;
}

// How a table column's numbers read: by its name (bytes, fractions), else plain.
function columnUnit(column) {
  if (column === 'bytes' || column.endsWith('_bytes')) { return 'bytes'; }
  return ['fill', 'share', 'kv_usage'].includes(column) ? 'fraction' : '';
}

function renderCards(cards) {
  const box = document.getElementById('cards'); box.replaceChildren();
  for (const card of cards) {
    const node = el('div', {'class': 'card', 'data-card': card.id, 'data-value': String(card.value)});
    node.append(el('div', {'class': 'label'}, card.label),
                el('div', {'class': 'value'}, formatValue(card.value, card.unit)));
    box.append(node);
  }
}

function renderSeries(series) {
  const box = document.getElementById('series'); box.replaceChildren();
  const NS = 'http://www.w3.org/2000/svg';
  for (const s of series) {
    const node = el('div', {'class': 'chart'});
    const last = s.points.length ? s.points[s.points.length - 1][1] : null;
    node.append(el('div', {'class': 'label'}, s.label + ': ' + formatValue(last, s.unit)));
    const svg = document.createElementNS(NS, 'svg');
    svg.setAttribute('viewBox', '0 0 300 90'); svg.setAttribute('preserveAspectRatio', 'none');
    svg.setAttribute('data-series', s.id); svg.setAttribute('data-points', String(s.points.length));
    if (s.points.length > 1) {
      const ts = s.points.map(p => p[0]), vs = s.points.map(p => p[1]);
      const t0 = Math.min(...ts), t1 = Math.max(...ts), top = Math.max(...vs, s.unit === 'fraction' ? 1 : 0);
      const line = document.createElementNS(NS, 'polyline');
      line.setAttribute('points', s.points.map(([t, v]) =>
        ((t - t0) / Math.max(t1 - t0, 1e-9) * 300).toFixed(1) + ',' +
        (88 - (top > 0 ? v / top : 0) * 86).toFixed(1)).join(' '));
      svg.append(line);
    }
    node.append(svg); box.append(node);
  }
}

function renderTables(tables) {
  const box = document.getElementById('tables'); box.replaceChildren();
  for (const t of tables) {
    const section = el('section', {'class': 'table'});
    section.append(el('h2', {}, t.title + (t.omitted ? ' (' + t.omitted + ' more not shown)' : '')));
    const table = el('table', {'data-table': t.id}), head = el('tr');
    for (const c of t.columns) { head.append(el('th', {}, c)); }
    table.append(head);
    t.rows.forEach((row, i) => {
      const tr = el('tr', {'data-row': String(i)});
      row.forEach((cell, j) => {
        const column = t.columns[j];
        if (typeof cell !== 'number') { tr.append(el('td', {'data-col': column}, cell === null ? '-' : String(cell))); return; }
        tr.append(el('td', {'data-col': column, 'data-value': String(cell), 'class': 'num'},
                     formatValue(cell, columnUnit(column))));
      });
      table.append(tr);
    });
    section.append(table); box.append(section);
  }
}

function setStatus(state, text) {
  const status = document.getElementById('status');
  status.setAttribute('data-state', state); status.textContent = text;
}

async function poll() {
  try {
    const answer = await fetch(DATA_URL, {credentials: 'same-origin', cache: 'no-store'});
    if (answer.status === 401) { setStatus('auth', 'the key was refused: reload to enter it'); return; }
    if (!answer.ok) { setStatus('error', 'HTTP ' + answer.status); return; }
    const data = await answer.json();
    document.getElementById('title').textContent = data.title;
    document.title = data.title;
    renderCards(data.cards); renderSeries(data.series); renderTables(data.tables);
    setStatus('ok', 'updated ' + new Date(data.generated_at * 1000).toLocaleTimeString());
  } catch (err) {
    setStatus('error', 'unreachable: ' + err);
  }
}
poll(); setInterval(poll, POLL_MS);
"""


def dashboard_html() -> str:
    """The page: a header (title, status), then cards, series and tables as data comes."""
    script = _SCRIPT % {"poll_ms": int(POLL_INTERVAL_S * 1000)}
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>kvhive</title><style>{_STYLE}</style></head><body>"
            "<header><h1 id=\"title\">kvhive</h1>"
            "<span id=\"status\" data-state=\"loading\">loading</span></header>"
            "<main><div id=\"cards\"></div><div id=\"series\"></div><div id=\"tables\"></div></main>"
            f"<script>{script}</script></body></html>")
