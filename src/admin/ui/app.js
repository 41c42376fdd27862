// Tether admin page: polls the node's admin API and renders it. Plain DOM, no frameworks.
// Every string from the API goes through textContent (never innerHTML).

const TOKEN_KEY = 'tether-admin-token';
const NODE_POLL_MS = 1000;
const QUEUES_POLL_MS = 2000;
const CLUSTER_POLL_MS = 3000;
const CHART_WINDOW_MS = 120_000;
const PAGE_SIZE = 100;
const MAX_LIMIT = 1000;

const $ = (sel) => document.querySelector(sel);

// ---------- formatting ----------

const nf = new Intl.NumberFormat('en-US');
const nf1 = new Intl.NumberFormat('en-US', { maximumFractionDigits: 1 });

function fmtInt(n) {
  return n == null ? '–' : nf.format(n);
}

function fmtRate(r) {
  if (r == null || !Number.isFinite(r)) return '–';
  if (r === 0) return '0';
  if (r < 10) return r.toFixed(1);
  return nf.format(Math.round(r));
}

function fmtBytes(b) {
  if (b == null) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = b;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return i === 0 ? `${v} B` : `${nf1.format(v)} ${units[i]}`;
}

function fmtDuration(ms) {
  if (ms == null || !Number.isFinite(ms)) return '–';
  if (ms < 0) ms = 0;
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = Math.floor(ms / 1000);
  if (s < 60) return `${nf1.format(ms / 1000)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${s % 60} s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h} h ${m % 60} min`;
  return `${Math.floor(h / 24)} d ${h % 24} h`;
}

// When a queue will be drained at its current ack rate ("–" when it is empty or not draining).
function fmtEta(q) {
  if (!q.pending_events || q.drain_eta_secs == null) return '–';
  return q.drain_eta_secs < 1 ? '< 1 s' : fmtDuration(q.drain_eta_secs * 1000);
}

function fmtTime(ms) {
  return ms == null ? '' : new Date(ms).toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
}

// ---------- DOM helpers ----------

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else if (k.startsWith('data-') || k.startsWith('aria-') || k === 'title' || k === 'scope' || k === 'role' || k === 'tabindex') {
      e.setAttribute(k, String(v));
    } else e[k] = v;
  }
  for (const c of children) {
    if (c == null) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function setText(sel, text) {
  const e = typeof sel === 'string' ? $(sel) : sel;
  if (e && e.textContent !== text) e.textContent = text;
}

function setField(root, field, text, value) {
  const e = root.querySelector(`[data-field="${field}"]`);
  if (!e) return;
  setText(e, text);
  if (value !== undefined) e.dataset.value = value == null ? '' : String(value);
}

// ---------- API ----------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let token = sessionStorage.getItem(TOKEN_KEY) || '';
let authBlocked = false;

async function api(path) {
  const headers = { Accept: 'application/json' };
  if (token) headers.Authorization = `Bearer ${token}`;
  let res;
  try {
    res = await fetch(path, { headers, cache: 'no-store' });
  } catch (e) {
    throw new ApiError(0, 'network', `cannot reach the node (${e.message})`);
  }
  let body = null;
  try {
    body = await res.json();
  } catch {
    body = null;
  }
  if (!res.ok) {
    const err = body && body.error ? body.error : {};
    throw new ApiError(res.status, err.code || `http_${res.status}`, err.message || `HTTP ${res.status}`);
  }
  return body;
}

function handleError(e, where) {
  if (e instanceof ApiError && (e.status === 401 || e.status === 403)) {
    showAuth(e);
    return;
  }
  setConn(false, e.message);
  if (where) {
    where.hidden = false;
    setText(where, e.message);
  }
}

function showAuth(e) {
  authBlocked = true;
  $('#auth').hidden = false;
  $('#main').hidden = true;
  const msg = e.status === 403
    ? `The token was refused: ${e.message}. Enter the token of an admin principal.`
    : token
      ? `The token was not accepted: ${e.message}.`
      : 'This node authenticates clients. Enter the bearer token of an admin principal; it is kept in this browser tab only.';
  setText('#auth-message', msg);
  $('#token').focus();
}

function hideAuth() {
  authBlocked = false;
  $('#auth').hidden = true;
  $('#main').hidden = false;
  $('#sign-out').hidden = !token;
}

let connOk = null;
function setConn(ok, message) {
  const e = $('#conn-status');
  if (ok) {
    if (connOk !== true) {
      e.className = 'conn ok';
      setText(e, 'live');
      e.title = 'Polling the node';
    }
  } else {
    e.className = 'conn bad';
    setText(e, 'offline');
    e.title = message || '';
  }
  connOk = ok;
}

// ---------- node, summary, chart ----------

let clockSkew = 0; // server now_ms minus local Date.now()
const serverNow = () => Date.now() + clockSkew;

const samples = []; // {t, publish, delivery} rates per second
let lastCounters = null;

function updateRates(node) {
  const t = node.now_ms ?? Date.now();
  const c = node.counters || {};
  if (lastCounters) {
    const dt = (t - lastCounters.t) / 1000;
    const dp = (c.events_published ?? 0) - lastCounters.published;
    const dd = (c.events_delivered ?? 0) - lastCounters.delivered;
    if (dt > 0 && dp >= 0 && dd >= 0) {
      samples.push({ t, publish: dp / dt, delivery: dd / dt });
    } else if (dp < 0 || dd < 0) {
      samples.length = 0; // the node restarted: its counters began again
    }
  }
  lastCounters = { t, published: c.events_published ?? 0, delivered: c.events_delivered ?? 0 };
  while (samples.length && samples[0].t < t - CHART_WINDOW_MS) samples.shift();
  const last = samples[samples.length - 1];
  setText('#publish-rate', last ? fmtRate(last.publish) : '–');
  setText('#delivery-rate', last ? fmtRate(last.delivery) : '–');
  const canvas = $('#rate-chart');
  canvas.dataset.samples = String(samples.length);
  canvas.dataset.publishRate = last ? last.publish.toFixed(2) : '0';
  canvas.dataset.deliveryRate = last ? last.delivery.toFixed(2) : '0';
  canvas.dataset.maxPublishRate = Math.max(0, ...samples.map((s) => s.publish)).toFixed(2);
  canvas.dataset.maxDeliveryRate = Math.max(0, ...samples.map((s) => s.delivery)).toFixed(2);
  canvas.setAttribute('aria-label', last
    ? `Publish ${fmtRate(last.publish)} events per second, delivery ${fmtRate(last.delivery)} events per second`
    : 'Publish and delivery rates over the last two minutes');
  drawChart(t);
}

function niceMax(v) {
  if (v <= 5) return 5;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function axisLabel(v) {
  return Number.isInteger(v) ? nf.format(v) : nf1.format(v);
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

let lastChartT = null;
function drawChart(now = lastChartT) {
  lastChartT = now;
  const canvas = $('#rate-chart');
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (!w || !h) return;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);

  const colors = {
    grid: cssVar('--grid'), text: cssVar('--muted'), publish: cssVar('--publish'), delivery: cssVar('--delivery'),
  };
  const font = '11px system-ui, sans-serif';
  const max = niceMax(Math.max(0, ...samples.map((s) => Math.max(s.publish, s.delivery))));
  ctx.font = font;
  const left = Math.ceil(ctx.measureText(axisLabel(max)).width) + 12;
  const right = 8;
  const top = 8;
  const bottom = 20;
  const pw = w - left - right;
  const ph = h - top - bottom;
  const end = now ?? Date.now();
  const x = (t) => left + pw * (1 - (end - t) / CHART_WINDOW_MS);
  const y = (v) => top + ph * (1 - v / max);

  // grid and axis labels
  ctx.strokeStyle = colors.grid;
  ctx.fillStyle = colors.text;
  ctx.lineWidth = 1;
  ctx.textAlign = 'right';
  ctx.textBaseline = 'middle';
  for (let i = 0; i <= 4; i += 1) {
    const v = (max / 4) * i;
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(left, yy);
    ctx.lineTo(w - right, yy);
    ctx.stroke();
    ctx.fillText(axisLabel(v), left - 6, yy);
  }
  ctx.textBaseline = 'top';
  for (const [ago, label] of [[120_000, '−2 min'], [90_000, '−90 s'], [60_000, '−1 min'], [30_000, '−30 s'], [0, 'now']]) {
    const xx = x(end - ago);
    ctx.textAlign = ago === 120_000 ? 'left' : ago === 0 ? 'right' : 'center';
    ctx.fillText(label, xx, h - bottom + 5);
  }

  // series
  const series = [['delivery', colors.delivery], ['publish', colors.publish]];
  ctx.save();
  ctx.beginPath();
  ctx.rect(left, top - 2, pw, ph + 4);
  ctx.clip();
  for (const [key, color] of series) {
    if (samples.length === 0) continue;
    ctx.beginPath();
    samples.forEach((s, i) => {
      const px = x(s.t);
      const py = y(s[key]);
      if (i === 0) ctx.moveTo(px, py);
      else ctx.lineTo(px, py);
    });
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.lineJoin = 'round';
    ctx.stroke();
    // light fill under the line
    ctx.lineTo(x(samples[samples.length - 1].t), y(0));
    ctx.lineTo(x(samples[0].t), y(0));
    ctx.closePath();
    ctx.globalAlpha = 0.08;
    ctx.fillStyle = color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }
  ctx.restore();
  if (samples.length < 2) {
    ctx.fillStyle = colors.text;
    ctx.textAlign = 'center';
    ctx.textBaseline = 'middle';
    ctx.fillText('collecting samples…', left + pw / 2, top + ph / 2);
  }
}

function renderNode(node) {
  clockSkew = node.now_ms != null ? node.now_ms - Date.now() : 0;
  setText('#node-id', node.node_id ?? '–');
  setText('#version', node.version ?? '–');
  setText('#node-addr', node.addr ?? '–');
  setText('#uptime', fmtDuration((node.uptime_secs ?? 0) * 1000));
  document.title = `Tether admin · ${node.node_id}`;

  const ready = $('#ready');
  ready.dataset.ready = node.ready ? 'true' : 'false';
  ready.className = `badge ${node.ready ? 'ok' : 'bad'}`;
  setText(ready, node.ready ? 'ready' : 'not ready');
  const reasons = $('#ready-reasons');
  const list = node.ready ? [] : (node.reasons || []);
  reasons.replaceChildren(...list.map((r) => el('li', { text: r })));
  reasons.hidden = list.length === 0;

  const s = $('#summary');
  const q = node.queues || {};
  setField(s, 'connections', fmtInt(node.connections), node.connections);
  setField(s, 'queues_total', fmtInt(q.total), q.total);
  setField(s, 'queues_ready', fmtInt(q.ready), q.ready);
  setField(s, 'queues_connected', fmtInt(q.connected), q.connected);
  setField(s, 'queues_away', fmtInt(q.away), q.away);
  setField(s, 'pending_events', fmtInt(node.pending_events), node.pending_events);
  setField(s, 'pending_bytes', fmtBytes(node.pending_bytes), node.pending_bytes);
  setField(s, 'oldest_pending_age_ms', node.oldest_pending_age_ms == null ? 'none' : fmtDuration(node.oldest_pending_age_ms),
    node.oldest_pending_age_ms);
  const c = node.counters || {};
  setField(s, 'counters', `${fmtInt(c.events_published)} · ${fmtInt(c.events_delivered)} · ${fmtInt(c.events_acked)}`);
  updateRates(node);
}

// ---------- cluster ----------

function renderCluster(cl) {
  const info = cl.clustered
    ? `leader ${cl.leader ?? 'none'} · term ${fmtInt(cl.term)} · applied ${fmtInt(cl.applied_index)}`
    : 'single node';
  setText('#cluster-info', info);
  const rows = (cl.members || []).map((m) => el('tr', { 'data-node-id': m.node_id, class: m.self ? 'self' : '' },
    el('td', { 'data-field': 'node_id' }, el('span', { class: 'mono', text: m.node_id }),
      m.leader ? el('span', { class: 'tag leader', 'data-field': 'leader', text: 'leader' }) : null,
      m.self ? el('span', { class: 'tag', text: 'this node' }) : null,
      m.draining ? el('span', { class: 'tag', 'data-field': 'draining', text: 'draining' }) : null),
    el('td', { class: 'mono', 'data-field': 'addr', text: m.addr ?? '–' }),
    el('td', { 'data-field': 'alive', 'data-value': m.alive ? 'true' : 'false' },
      el('span', { class: `dot ${m.alive ? 'ready' : 'down'}`, 'aria-hidden': 'true' }), m.alive ? 'alive' : 'down')));
  $('#members tbody').replaceChildren(...rows);
}

// ---------- queues ----------

const view = { sort: 'pending', order: 'desc', state: '', role: 'primary', region: '', prefix: '' };
let queueRows = []; // the queues shown, in order
let queueNext = null;
let queuesGen = 0; // bumps when the query changes: answers to older queries are dropped

function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  for (const k of Object.keys(view)) if (p.has(k)) view[k] = p.get(k);
  if (!['id', 'pending', 'bytes', 'age'].includes(view.sort)) view.sort = 'pending';
  if (!['asc', 'desc'].includes(view.order)) view.order = 'desc';
  $('#filter-state').value = view.state;
  $('#filter-role').value = view.role;
  $('#filter-region').value = view.region;
  $('#filter-prefix').value = view.prefix;
}

function writeHash() {
  const p = new URLSearchParams();
  const defaults = { sort: 'pending', order: 'desc', state: '', role: 'primary', region: '', prefix: '' };
  for (const [k, v] of Object.entries(view)) if (v !== defaults[k]) p.set(k, v);
  const h = p.toString();
  history.replaceState(null, '', h ? `#${h}` : location.pathname + location.search);
}

function queuesQuery(limit, after) {
  const p = new URLSearchParams({ limit: String(limit), sort: view.sort, order: view.order, role: view.role });
  if (view.state) p.set('state', view.state);
  if (view.region) p.set('region', view.region);
  if (view.prefix) p.set('prefix', view.prefix);
  if (after) p.set('after', after);
  return `/api/v1/queues?${p}`;
}

function stateCell(state) {
  return el('td', { 'data-field': 'state', 'data-value': state },
    el('span', { class: `state ${state}` }, el('span', { class: `dot ${state}`, 'aria-hidden': 'true' }), state));
}

function queueRow(q) {
  const now = serverNow();
  const expiresIn = q.expires_at_ms == null ? null : q.expires_at_ms - now;
  const idCell = el('td', { 'data-field': 'id', 'data-value': q.id },
    el('button', { type: 'button', class: 'qlink mono', text: q.id, 'aria-label': `Details of queue ${q.id}` }));
  if (q.durable_id == null) idCell.append(el('span', { class: 'tag', text: 'non-durable' }));
  return el('tr', { 'data-queue-id': q.id, 'data-state': q.state },
    idCell,
    el('td', { class: 'mono', 'data-field': 'node', text: q.node ?? '–' }),
    el('td', { 'data-field': 'role', text: q.role === 'secondary' ? `copy of ${q.primary ?? '?'}` : (q.role ?? '–') }),
    stateCell(q.state),
    el('td', { class: 'num', 'data-field': 'pending_events', 'data-value': q.pending_events, text: fmtInt(q.pending_events) }),
    el('td', { class: 'num', 'data-field': 'pending_bytes', 'data-value': q.pending_bytes ?? '', text: fmtBytes(q.pending_bytes) }),
    el('td', { class: 'num', 'data-field': 'oldest_pending_age_ms', 'data-value': q.oldest_pending_age_ms ?? '',
      text: q.oldest_pending_age_ms == null ? '–' : fmtDuration(q.oldest_pending_age_ms) }),
    el('td', { 'data-field': 'away_since_ms', 'data-value': q.away_since_ms ?? '', title: fmtTime(q.away_since_ms),
      text: q.away_since_ms == null ? '–' : `${fmtDuration(now - q.away_since_ms)} ago` }),
    el('td', { 'data-field': 'expires_at_ms', 'data-value': q.expires_at_ms ?? '', title: fmtTime(q.expires_at_ms),
      class: expiresIn != null && expiresIn < 60_000 ? 'soon' : null,
      text: expiresIn == null ? '–' : expiresIn <= 0 ? 'due' : fmtDuration(expiresIn) }),
    el('td', { class: 'num', 'data-field': 'ack_rate', 'data-value': q.ack_rate ?? '', text: q.ack_rate == null ? '–' : `${fmtRate(q.ack_rate)}/s` }),
    el('td', { class: 'num', 'data-field': 'drain_eta_secs', 'data-value': q.drain_eta_secs ?? '', text: fmtEta(q) }));
}

function renderQueues(total, unreachable) {
  const tbody = $('#queues tbody');
  tbody.replaceChildren(...queueRows.map(queueRow));
  setText('#queues-total', total == null ? '' : `${fmtInt(queueRows.length)} of ${fmtInt(total)}`);
  $('#queues-total').dataset.value = total ?? '';
  $('#queues-empty').hidden = queueRows.length > 0;
  $('#queues-more').hidden = !queueNext;
  const un = $('#queues-unreachable');
  if (unreachable && unreachable.length) {
    un.hidden = false;
    setText(un, `Not answering, their queues are missing: ${unreachable.join(', ')}`);
  } else un.hidden = true;
  updateSortHeaders();
}

function updateSortHeaders() {
  for (const th of document.querySelectorAll('#queues th[data-sort]')) {
    th.setAttribute('aria-sort', th.dataset.sort === view.sort ? (view.order === 'asc' ? 'ascending' : 'descending') : 'none');
  }
}

async function refreshQueues() {
  const gen = queuesGen;
  const limit = Math.min(MAX_LIMIT, Math.max(PAGE_SIZE, queueRows.length));
  const res = await api(queuesQuery(limit));
  if (gen !== queuesGen) return;
  queueRows = res.queues || [];
  queueNext = res.next ?? null;
  $('#queues-error').hidden = true;
  renderQueues(res.total, res.unreachable);
}

async function moreQueues() {
  if (!queueNext) return;
  const gen = queuesGen;
  const btn = $('#queues-more');
  btn.disabled = true;
  try {
    const res = await api(queuesQuery(PAGE_SIZE, queueNext));
    if (gen !== queuesGen) return;
    const seen = new Set(queueRows.map((q) => q.id));
    queueRows = queueRows.concat((res.queues || []).filter((q) => !seen.has(q.id)));
    queueNext = res.next ?? null;
    renderQueues(res.total, res.unreachable);
  } catch (e) {
    handleError(e, $('#queues-error'));
  } finally {
    btn.disabled = false;
  }
}

function queryChanged() {
  queuesGen += 1;
  queueRows = [];
  queueNext = null;
  writeHash();
  pollers.queues.now();
}

// ---------- queue detail ----------

let detailId = null;

function field(dl, label, value, key) {
  dl.append(el('div', {}, el('dt', { text: label }), el('dd', { 'data-field': key, text: value })));
}

function renderDetail(q) {
  const now = serverNow();
  setText('#detail-id', q.id);
  const dl = $('#detail-fields');
  dl.replaceChildren();
  field(dl, 'Durable id', q.durable_id ?? 'non-durable', 'durable_id');
  field(dl, 'Node', q.node ?? '–', 'node');
  field(dl, 'Role', q.role === 'secondary' ? `copy of ${q.primary}` : `${q.role ?? '–'}`, 'role');
  field(dl, 'Primary', q.primary ?? '–', 'primary');
  field(dl, 'State', q.state ?? '–', 'state');
  field(dl, 'Pending events', fmtInt(q.pending_events), 'pending_events');
  field(dl, 'Pending bytes', fmtBytes(q.pending_bytes), 'pending_bytes');
  field(dl, 'Oldest pending', q.oldest_pending_age_ms == null ? '–' : fmtDuration(q.oldest_pending_age_ms), 'oldest_pending_age_ms');
  field(dl, 'Acked / end offset', `${fmtInt(q.acked_offset)} / ${fmtInt(q.end_offset)}`, 'offsets');
  field(dl, 'Timeout', q.timeout_secs == null ? '–' : fmtDuration(q.timeout_secs * 1000), 'timeout_secs');
  field(dl, 'Away since', q.away_since_ms == null ? '–' : `${fmtTime(q.away_since_ms)} (${fmtDuration(now - q.away_since_ms)} ago)`, 'away_since_ms');
  field(dl, 'Expires', q.expires_at_ms == null ? '–' : `${fmtTime(q.expires_at_ms)} (${q.expires_at_ms > now ? `in ${fmtDuration(q.expires_at_ms - now)}` : 'due'})`, 'expires_at_ms');
  field(dl, q.enqueue_rate != null ? 'Enqueue / delivery / ack rate' : 'Delivery / ack rate',
    [q.enqueue_rate, q.delivery_rate, q.ack_rate].filter((r, i) => i > 0 || r != null).map((r) => `${fmtRate(r)}/s`).join(' · '), 'rates');
  field(dl, 'Drain ETA', fmtEta(q), 'drain_eta_secs');
  dl.querySelector('[data-field="pending_events"]').dataset.value = String(q.pending_events ?? '');

  const interests = q.interests || [];
  $('#detail-interests tbody').replaceChildren(...(interests.length ? interests.map((i) => el('tr', { 'data-field': 'interest' },
    el('td', { class: 'mono', 'data-field': 'region', text: i.region }),
    el('td', { 'data-field': 'kind', text: i.kind }),
    el('td', { class: 'mono', 'data-field': 'spec', text: i.kind === 'all' ? '(all keys)' : (i.spec ?? '') }),
    el('td', { 'data-field': 'durable', text: i.durable ? 'yes' : 'no' })))
    : [el('tr', {}, el('td', { colSpan: 4, class: 'muted', text: 'No interest registered.' }))]));

  const copies = q.copies || [];
  $('#detail-copies').hidden = copies.length === 0;
  $('#detail-no-copies').hidden = copies.length > 0;
  $('#detail-copies tbody').replaceChildren(...copies.map((c) => el('tr', { 'data-field': 'copy', 'data-node-id': c.node },
    el('td', { class: 'mono', text: c.node }),
    el('td', { class: `num${c.lag_entries > 0 ? ' lagging' : ''}`, 'data-field': 'lag_entries', 'data-value': c.lag_entries,
      text: fmtInt(c.lag_entries) }))));
}

async function loadDetail() {
  if (detailId == null) return;
  const id = detailId;
  try {
    const q = await api(`/api/v1/queues/${encodeURIComponent(id)}`);
    if (id !== detailId) return;
    $('#detail-error').hidden = true;
    renderDetail(q);
  } catch (e) {
    if (id !== detailId) return;
    if (e.status === 404) {
      $('#detail-error').hidden = false;
      setText('#detail-error', 'This queue no longer exists.');
    } else handleError(e, $('#detail-error'));
  }
}

function openDetail(id) {
  detailId = id;
  const dlg = $('#queue-detail');
  setText('#detail-id', id);
  $('#detail-fields').replaceChildren();
  $('#detail-interests tbody').replaceChildren();
  $('#detail-copies tbody').replaceChildren();
  $('#detail-error').hidden = true;
  dlg.dataset.queueId = id;
  if (!dlg.open) dlg.showModal();
  loadDetail();
}

// ---------- polling ----------

// Runs fn every interval ms (after the previous run ended); now() runs it at once, or right
// after the run in progress.
function poller(fn, interval) {
  let timer = null;
  let running = false;
  let again = false;
  const run = async () => {
    clearTimeout(timer);
    if (running) {
      again = true;
      return;
    }
    running = true;
    try {
      if (!authBlocked) await fn();
    } catch (e) {
      handleError(e);
    } finally {
      running = false;
      if (again) {
        again = false;
        timer = setTimeout(run, 0);
      } else timer = setTimeout(run, interval);
    }
  };
  return { now: run };
}

const pollers = {
  node: poller(async () => {
    renderNode(await api('/api/v1/node'));
    setConn(true);
    if (!authBlocked) hideAuth();
  }, NODE_POLL_MS),
  cluster: poller(async () => renderCluster(await api('/api/v1/cluster')), CLUSTER_POLL_MS),
  queues: poller(async () => {
    await refreshQueues();
    if (detailId != null && $('#queue-detail').open) await loadDetail();
  }, QUEUES_POLL_MS),
};

function startAll() {
  for (const p of Object.values(pollers)) p.now();
}

// ---------- wiring ----------

function debounce(fn, ms) {
  let t = null;
  return (...a) => {
    clearTimeout(t);
    t = setTimeout(() => fn(...a), ms);
  };
}

function init() {
  readHash();
  $('#auth-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    token = $('#token').value.trim();
    $('#token').value = '';
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
    hideAuth();
    startAll();
  });
  $('#sign-out').addEventListener('click', () => {
    token = '';
    sessionStorage.removeItem(TOKEN_KEY);
    $('#sign-out').hidden = true;
    startAll();
  });

  for (const th of document.querySelectorAll('#queues th[data-sort]')) {
    th.querySelector('button').addEventListener('click', () => {
      const key = th.dataset.sort;
      if (view.sort === key) view.order = view.order === 'desc' ? 'asc' : 'desc';
      else {
        view.sort = key;
        view.order = key === 'id' ? 'asc' : 'desc';
      }
      updateSortHeaders();
      queryChanged();
    });
  }
  $('#filter-state').addEventListener('change', (e) => { view.state = e.target.value; queryChanged(); });
  $('#filter-role').addEventListener('change', (e) => { view.role = e.target.value; queryChanged(); });
  const onText = debounce(() => {
    view.region = $('#filter-region').value.trim();
    view.prefix = $('#filter-prefix').value.trim();
    queryChanged();
  }, 300);
  $('#filter-region').addEventListener('input', onText);
  $('#filter-prefix').addEventListener('input', onText);
  $('#queue-filters').addEventListener('submit', (e) => e.preventDefault());
  $('#queues-more').addEventListener('click', moreQueues);

  $('#queues tbody').addEventListener('click', (e) => {
    const tr = e.target.closest('tr[data-queue-id]');
    if (tr && !e.target.closest('a')) openDetail(tr.dataset.queueId);
  });
  const dlg = $('#queue-detail');
  $('#detail-close').addEventListener('click', () => dlg.close());
  dlg.addEventListener('click', (e) => { if (e.target === dlg) dlg.close(); });
  dlg.addEventListener('close', () => { detailId = null; delete dlg.dataset.queueId; });

  window.addEventListener('resize', () => drawChart());
  window.addEventListener('hashchange', () => { readHash(); queryChanged(); });
  matchMedia('(prefers-color-scheme: dark)').addEventListener?.('change', () => drawChart());

  updateSortHeaders();
  drawChart(Date.now());
  startAll();
}

init();
