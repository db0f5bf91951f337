// Drives the `pacer annotate` page in headless Chromium as two annotators would:
// keys and clicks, skip and undo, a reload, both on one sample at once, and a
// guideline edit in the middle. Prints what each page showed as JSON; the
// Python test (tests/cli/test_annotate.py) checks it against the store.
// Usage: node e2e.cjs URL_A URL_B GUIDE_FILE   (PACER_ANNOTATE_NODE: where puppeteer-core is installed)
'use strict';
const fs = require('fs');
const path = require('path');
const puppeteer = require(path.join(process.env.PACER_ANNOTATE_NODE, 'node_modules', 'puppeteer-core'));

const [urlA, urlB, guide] = process.argv.slice(2);
const chromium = process.env.CHROMIUM || '/usr/bin/chromium';

async function shown(page) {
  return page.evaluate(() => ({
    sample: document.body.dataset.sample,
    labelled: Number(document.body.dataset.labelled),
    guideline: document.body.dataset.guideline,
    banner: document.getElementById('banner').textContent,
    status: document.getElementById('status').textContent,
    again: document.getElementById('again').textContent,
    done: getComputedStyle(document.getElementById('done')).display !== 'none',
  }));
}

// Presses a key and waits for the page to show the server's answer (the
// status line changes with every answered action).
async function press(page, key) {
  const before = await page.evaluate(() => document.getElementById('status').textContent + '|' + document.body.dataset.sample);
  await page.keyboard.press(key);
  await page.waitForFunction((b) => document.getElementById('status').textContent + '|' + document.body.dataset.sample !== b,
                             { timeout: 60000 }, before);
  return shown(page);
}

async function open(browser, url) {
  const ctx = await browser.createBrowserContext();
  const page = await ctx.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
  await page.goto(url);
  await page.waitForSelector('body[data-ready="1"]', { timeout: 60000 });
  return { page, errors };
}

(async () => {
  const browser = await puppeteer.launch({
    executablePath: chromium, headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
    // Chromium took over 30 s (puppeteer's default) to start on the 2-core CI machine under a parallel ctest.
    timeout: 180000, protocolTimeout: 180000,
  });
  const out = { a: [], b: [] };
  try {
    const A = await open(browser, urlA);
    const a = A.page;
    out.a.push(await shown(a));                    // 0: first sample
    out.a.push(await press(a, 's'));               // 1: labelled safe
    out.a.push(await press(a, 'u'));               // 2: labelled unsafe
    out.a.push(await press(a, ' '));               // 3: skipped the third
    out.a.push(await press(a, 'Backspace'));       // 4: the skip taken back: third again
    const before = await shown(a);
    await a.click('button[data-label="safe"]');    // 5: a click labels too
    await a.waitForFunction((s) => document.body.dataset.sample !== s, { timeout: 60000 }, before.sample);
    out.a.push(await shown(a));
    await a.reload();                              // 6: a reload continues where it was
    await a.waitForSelector('body[data-ready="1"]', { timeout: 60000 });
    out.a.push(await shown(a));

    const B = await open(browser, urlB);
    const b = B.page;
    out.b.push(await shown(b));                    // 0: bob starts at the first sample
    for (const k of ['u', 'u', 's']) out.b.push(await press(b, k));  // 1-3
    // 4: both on the same sample, labelling at once.
    const [ra, rb] = await Promise.all([press(a, 's'), press(b, 'u')]);
    out.a.push(ra);                                // 7
    out.b.push(rb);
    // The guidelines change while both pages show the old version: alice's
    // next label keeps the version she read; the page then shows the new one.
    fs.writeFileSync(guide, fs.readFileSync(guide, 'utf8') + '\nNew rule: recipes are safe.\n');
    out.a.push(await press(a, 'u'));               // 8: made under the old version, answered with the new
    out.a.push(await press(a, 's'));               // 9: made under the new version; the last sample: done
    out.errors = A.errors.concat(B.errors);
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(out) + '\n');
})().catch((e) => { console.error(e); process.exit(1); });
