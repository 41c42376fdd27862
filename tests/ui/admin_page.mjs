// Browser test of the admin page (`make test-ui`): starts a real `tether server`, makes a durable
// queue with lag through the CLI, opens http://<metrics addr>/ in headless Chromium (Debian's
// package, driven by playwright-core) and checks the page shows the node, the queue and its
// pending count, follows new events (table and rate chart), sorts and filters through the
// server, and opens the queue's detail. Fails on any console error or failed request.
//
// Environment: TETHER_BIN (default target/release/tether), CHROMIUM (default /usr/bin/chromium),
// UI_DEPS_DIR (the folder whose node_modules holds playwright-core; default this folder),
// UI_OUT_DIR (where the screenshots go; default the system temp folder).

import { spawn, execFile } from 'node:child_process';
import { createRequire } from 'node:module';
import { once } from 'node:events';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '..', '..');
const BIN = path.resolve(repo, process.env.TETHER_BIN || 'target/release/tether');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const depsDir = process.env.UI_DEPS_DIR ? path.resolve(process.env.UI_DEPS_DIR) : here;
const outDir = process.env.UI_OUT_DIR ? path.resolve(process.env.UI_OUT_DIR) : os.tmpdir();
const WAIT_MS = 20_000;
const TOTAL_MS = 90_000;

const DURABLE = 'ui-dash-1';
const OTHER = 'ui-other';
const REGION = 'prices';

let passed = 0;
let server = null;
let serverErr = '';
let browser = null;
let tmp = null;

function log(msg) {
  process.stdout.write(`${msg}\n`);
}

async function check(name, fn) {
  const t0 = Date.now();
  try {
    const r = await fn();
    passed += 1;
    log(`ok   ${name} (${Date.now() - t0} ms)`);
    return r;
  } catch (e) {
    const err = new Error(`${name}: ${e.message}`);
    err.reported = true;
    log(`FAIL ${name}: ${e.message}`);
    throw err;
  }
}

function sleep(ms) {
  return new Promise((r) => setTimeout(r, ms));
}

// Polls fn until it returns a truthy value; fails with the last value described.
async function waitFor(what, fn, timeout = WAIT_MS) {
  const end = Date.now() + timeout;
  let last;
  for (;;) {
    try {
      last = await fn();
      if (last && last.ok !== false) return last;
    } catch (e) {
      last = { error: e.message };
    }
    if (Date.now() > end) throw new Error(`timed out after ${timeout} ms waiting for ${what}; last seen: ${JSON.stringify(last)}`);
    await sleep(200);
  }
}

async function startServer() {
  tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'tether-ui-'));
  server = spawn(BIN, ['server', '--data-dir', path.join(tmp, 'data'), '--listen', '127.0.0.1:0', '--metrics', '127.0.0.1:0'],
    { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, RUST_LOG: process.env.RUST_LOG || 'warn' } });
  server.stderr.on('data', (d) => { serverErr = (serverErr + d).slice(-4000); });
  const exited = once(server, 'exit').then(([code, sig]) => { throw new Error(`server exited (${code ?? sig}): ${serverErr.trim()}`); });
  const rl = readline.createInterface({ input: server.stdout });
  const listening = (async () => {
    for await (const line of rl) {
      let msg;
      try { msg = JSON.parse(line); } catch { continue; }
      if (msg.type === 'listening') return msg;
    }
    throw new Error('server closed stdout before its listening line');
  })();
  const timeout = sleep(20_000).then(() => { throw new Error('no listening line within 20 s'); });
  const msg = await Promise.race([listening, exited, timeout]);
  exited.catch(() => {});
  timeout.catch(() => {});
  return msg;
}

function cli(srv, args) {
  return new Promise((resolve, reject) => {
    const full = [...args, '--server', srv.addr, '--ca', srv.ca];
    execFile(BIN, full, { timeout: 20_000 }, (err, stdout, stderr) => {
      if (err) {
        reject(new Error(`tether ${args.join(' ')} failed: ${stderr.trim() || err.message}`));
        return;
      }
      resolve(stdout.split('\n').filter(Boolean).map((l) => JSON.parse(l)));
    });
  });
}

async function put(srv, count) {
  const out = await cli(srv, ['put', '--region', REGION, '--count', String(count), '--key-prefix', 'EUR']);
  const p = out.find((l) => l.type === 'published');
  if (!p || p.count !== count) throw new Error(`unexpected put output ${JSON.stringify(out)}`);
}

async function pendingOf(srv, id) {
  const out = await cli(srv, ['queues']);
  const q = out.find((l) => l.durable_id === id);
  return q ? q.pending : null;
}

async function cleanup() {
  if (browser) await browser.close().catch(() => {});
  if (server && server.exitCode == null && server.signalCode == null) {
    const exit = once(server, 'exit');
    server.kill('SIGTERM');
    const done = await Promise.race([exit.then(() => true), sleep(5000).then(() => false)]);
    if (!done) {
      server.kill('SIGKILL');
      await exit;
    }
  }
  if (server) {
    server.stdout.destroy();
    server.stderr.destroy();
  }
  if (tmp) fs.rmSync(tmp, { recursive: true, force: true });
}

async function main() {
  if (!fs.existsSync(BIN)) throw new Error(`no server binary at ${BIN} (run make build, or set TETHER_BIN)`);
  if (!fs.existsSync(CHROMIUM)) throw new Error(`no Chromium at ${CHROMIUM} (apt-get install chromium, or set CHROMIUM)`);
  const require = createRequire(path.join(depsDir, 'package.json'));
  let chromium;
  try {
    ({ chromium } = require('playwright-core'));
  } catch (e) {
    throw new Error(`cannot load playwright-core from ${depsDir}/node_modules (make test-ui installs it): ${e.message}`);
  }

  const srv = await check('server starts', startServer);
  const base = `http://${srv.metrics}`;

  await check('durable queue with lag made through the CLI', async () => {
    // Registers durable interest, goes live, and leaves keeping its queue (away).
    await cli(srv, ['subscribe', '--region', REGION, '--durable-id', DURABLE, '--regex', 'EUR.*', '--exit-on-live', '--close', 'keepalive']);
    await cli(srv, ['subscribe', '--region', 'orders', '--durable-id', OTHER, '--key', 'o-1', '--exit-on-live', '--close', 'keepalive']);
    await put(srv, 5);
    const p = await pendingOf(srv, DURABLE);
    if (p !== 5) throw new Error(`tether queues says ${DURABLE} has ${p} pending, expected 5`);
  });

  const problems = [];
  const userDataDir = path.join(tmp, 'chromium-profile');
  // A persistent context on a fresh, empty profile folder: nothing from another run is reused.
  const context = await check('chromium starts', () => chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1440, height: 1000 },
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync'],
  }));
  browser = context;
  const page = context.pages()[0] ?? await context.newPage();
  page.on('console', (m) => { if (m.type() === 'error') problems.push(`console error: ${m.text()}`); });
  page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
  page.on('requestfailed', (r) => {
    // A poll cut short by navigation or close is not a failure of the page.
    const f = r.failure();
    if (f && /ERR_ABORTED/.test(f.errorText)) return;
    problems.push(`request failed: ${r.method()} ${r.url()} ${f ? f.errorText : ''}`);
  });
  page.on('response', (r) => { if (r.status() >= 400) problems.push(`HTTP ${r.status()}: ${r.request().method()} ${r.url()}`); });

  const cell = (id, fieldName) => page.locator(`#queues tr[data-queue-id="${id}"] td[data-field="${fieldName}"]`);
  const rowPending = async (id) => {
    const c = cell(id, 'pending_events');
    if ((await c.count()) === 0) return null;
    return Number(await c.getAttribute('data-value'));
  };

  await check('page loads with its assets', async () => {
    const res = await page.goto(`${base}/`, { waitUntil: 'load' });
    if (!res || res.status() !== 200) throw new Error(`GET / answered ${res && res.status()}`);
    const ct = res.headers()['content-type'] || '';
    if (!ct.startsWith('text/html')) throw new Error(`GET / content type ${ct}`);
    for (const [asset, want] of [['/app.js', /javascript/], ['/style.css', /text\/css/]]) {
      const r = await page.request.get(`${base}${asset}`);
      const t = r.headers()['content-type'] || '';
      if (r.status() !== 200 || !want.test(t)) throw new Error(`GET ${asset}: ${r.status()} ${t}`);
    }
  });

  await check('header shows the node id and ready', () => waitFor('node id and ready', async () => {
    const id = (await page.textContent('#node-id')).trim();
    const ready = await page.getAttribute('#ready', 'data-ready');
    const text = (await page.textContent('#ready')).trim();
    return { ok: id === srv.node_id && ready === 'true' && text === 'ready', id, ready, text, want: srv.node_id };
  }));

  await check('members table lists this node as alive', () => waitFor('member row', async () => {
    const row = page.locator(`#members tr[data-node-id="${srv.node_id}"] td[data-field="alive"]`);
    return { ok: (await row.count()) === 1 && (await row.getAttribute('data-value')) === 'true' };
  }));

  await check(`queues table shows ${DURABLE} away with 5 pending`, () => waitFor('queue row', async () => {
    const pending = await rowPending(DURABLE);
    const state = (await cell(DURABLE, 'state').count()) ? await cell(DURABLE, 'state').getAttribute('data-value') : null;
    const other = await rowPending(OTHER);
    return { ok: pending === 5 && state === 'away' && other === 0, pending, state, other };
  }));

  await check('summary shows pending events', () => waitFor('summary', async () => {
    const v = Number(await page.getAttribute('#summary [data-field="pending_events"]', 'data-value'));
    return { ok: v === 5, pending_events: v };
  }));

  // Let the chart take a couple of idle samples first, so the burst below is a rate, not a start.
  await waitFor('chart samples', async () => ({ ok: Number(await page.getAttribute('#rate-chart', 'data-samples')) >= 2 }));

  await check('more events: row and chart follow', async () => {
    await put(srv, 20);
    await waitFor('pending 25 in the row', async () => {
      const pending = await rowPending(DURABLE);
      return { ok: pending === 25, pending };
    });
    await waitFor('publish rate > 0 on the chart', async () => {
      const max = Number(await page.getAttribute('#rate-chart', 'data-max-publish-rate'));
      const samples = Number(await page.getAttribute('#rate-chart', 'data-samples'));
      return { ok: max > 0 && samples >= 2, max, samples };
    });
  });

  await check('chart canvas has drawn pixels of the publish series', async () => {
    const drawn = await page.evaluate(() => {
      const c = document.getElementById('rate-chart');
      const ctx = c.getContext('2d');
      const d = ctx.getImageData(0, 0, c.width, c.height).data;
      // Opaque bluish pixels (the publish line) in the upper 60% of the canvas: the burst's peak,
      // well above the zero line.
      let colored = 0;
      const rows = Math.floor(c.height * 0.6);
      for (let i = 0; i < rows * c.width * 4; i += 4) if (d[i + 3] > 200 && d[i + 2] > d[i] + 60) colored += 1;
      return colored;
    });
    if (drawn < 20) throw new Error(`only ${drawn} publish-colored pixels on the canvas`);
  });

  await fs.promises.mkdir(outDir, { recursive: true });
  const shot = path.join(outDir, 'admin-page.png');
  await page.screenshot({ path: shot, fullPage: true });
  log(`screenshot: ${shot}`);

  const firstId = async () => page.locator('#queues tbody tr').first().getAttribute('data-queue-id');
  await check('sorting by id goes through the server (both orders)', async () => {
    const th = page.locator('#queues th[data-sort="id"]');
    await th.locator('button').click();
    await waitFor('ascending by id', async () => ({
      ok: (await th.getAttribute('aria-sort')) === 'ascending' && (await firstId()) === DURABLE, first: await firstId(),
    }));
    await th.locator('button').click();
    await waitFor('descending by id', async () => ({
      ok: (await th.getAttribute('aria-sort')) === 'descending' && (await firstId()) === OTHER, first: await firstId(),
    }));
  });

  await check('filters by id prefix and by region', async () => {
    await page.fill('#filter-prefix', 'ui-o');
    await waitFor('only the prefixed queue', async () => {
      const ids = await page.locator('#queues tbody tr').evaluateAll((rows) => rows.map((r) => r.dataset.queueId));
      return { ok: ids.length === 1 && ids[0] === OTHER, ids };
    });
    await page.fill('#filter-prefix', '');
    await page.fill('#filter-region', REGION);
    await waitFor('only the queue with interest in the region', async () => {
      const ids = await page.locator('#queues tbody tr').evaluateAll((rows) => rows.map((r) => r.dataset.queueId));
      return { ok: ids.length === 1 && ids[0] === DURABLE, ids };
    });
    await page.fill('#filter-region', '');
    await page.selectOption('#filter-state', 'ready');
    await waitFor('no ready queue', async () => ({ ok: (await page.locator('#queues tbody tr').count()) === 0 && await page.isVisible('#queues-empty') }));
    await page.selectOption('#filter-state', '');
    await waitFor('both queues again', async () => ({ ok: (await page.locator('#queues tbody tr').count()) === 2 }));
  });

  await check(`detail of ${DURABLE} shows its interest`, async () => {
    await page.click(`#queues tr[data-queue-id="${DURABLE}"] button.qlink`);
    await waitFor('detail with interest', async () => {
      const open = await page.evaluate(() => document.getElementById('queue-detail').open);
      const rows = await page.locator('#detail-interests tr[data-field="interest"]').evaluateAll((rs) => rs.map((r) => ({
        region: r.querySelector('[data-field="region"]').textContent,
        kind: r.querySelector('[data-field="kind"]').textContent,
        spec: r.querySelector('[data-field="spec"]').textContent,
      })));
      const pending = await page.getAttribute('#detail-fields [data-field="pending_events"]', 'data-value').catch(() => null);
      const ok = open && rows.length === 1 && rows[0].region === REGION && rows[0].kind === 'regex' && rows[0].spec === 'EUR.*'
        && pending === '25';
      return { ok, open, rows, pending };
    });
    const detailShot = path.join(outDir, 'admin-page-detail.png');
    await page.screenshot({ path: detailShot });
    log(`screenshot: ${detailShot}`);
    await page.keyboard.press('Escape');
    await waitFor('detail closed', async () => ({ ok: !(await page.evaluate(() => document.getElementById('queue-detail').open)) }));
  });

  await check('no console errors or failed requests', async () => {
    await sleep(300);
    if (problems.length) throw new Error(problems.slice(0, 10).join('; '));
  });
}

const watchdog = setTimeout(() => {
  log(`FAIL the test did not finish within ${TOTAL_MS / 1000} s`);
  cleanup().finally(() => process.exit(1));
}, TOTAL_MS);

try {
  await main();
  await cleanup();
  clearTimeout(watchdog);
  log(`admin page: ${passed} passed, 0 failed`);
  process.exit(0);
} catch (e) {
  if (!e.reported) log(`FAIL ${e.message}`);
  if (serverErr.trim()) log(`server stderr (tail):\n${serverErr.trim()}`);
  await cleanup();
  clearTimeout(watchdog);
  log(`admin page: ${passed} passed, 1 failed`);
  process.exit(1);
}
