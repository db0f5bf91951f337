// The labelling page of `pacer annotate`: one sample at a time, labels by key.
// The server holds all state; the page shows what it answers, so a reload
// continues where the annotator was.
(function () {
  'use strict';
  const $ = (id) => document.getElementById(id);
  // The token rides in the URL's fragment: it survives a reload, stays per
  // tab (two annotators in one browser do not mix) and is never sent in a request line.
  const fromUrl = new URLSearchParams(location.hash.slice(1)).get('token') || new URLSearchParams(location.search).get('token');
  let token = fromUrl || '';
  let state = null;
  let busy = false;

  function banner(text, isError) {
    const b = $('banner');
    b.textContent = text;
    b.className = text ? (isError ? 'shown error' : 'shown') : '';
  }

  async function call(method, path, body) {
    const res = await fetch(path, {
      method,
      headers: { 'Authorization': 'Bearer ' + token, 'Content-Type': 'application/json' },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let j = null;
    try { j = await res.json(); } catch (e) { j = { error: 'the server answered ' + res.status + ' without JSON' }; }
    if (res.status === 401) { showLogin(j.error); return null; }
    if (!res.ok) throw new Error(j.error || ('HTTP ' + res.status));
    return j;
  }

  function showLogin(message) {
    $('login').style.display = 'block';
    $('work').style.display = 'none';
    banner(message || '', !!message);
  }

  function render(s) {
    const shownVersion = state && state.guideline.version;
    state = s;
    $('login').style.display = 'none';
    $('work').style.display = 'block';
    $('who').textContent = s.annotator;
    const p = s.progress;
    $('progress').textContent = p.labelled + ' / ' + p.samples + ' labelled' + (p.skipped ? ', ' + p.skipped + ' skipped' : '');
    $('guideline-version').textContent = s.guideline.version;
    $('guideline').textContent = s.guideline.text;
    if (shownVersion && shownVersion !== s.guideline.version) {
      banner('The guidelines changed (now ' + s.guideline.version + ', was ' + shownVersion +
             '). Labels made so far keep the version they were made under; please read the new text.', false);
    }
    const labels = $('labels');
    if (!labels.childElementCount) {
      for (const l of s.labels) {
        const b = document.createElement('button');
        b.type = 'button';
        b.dataset.label = l.name;
        b.title = l.description || '';
        const k = document.createElement('kbd');
        k.textContent = l.key;
        b.append(k, l.name);
        b.addEventListener('click', () => label(l.name));
        labels.append(b);
      }
    }
    const has = !!s.sample;
    $('sample').textContent = has ? s.sample.text : '';
    $('sample-id').textContent = has ? s.sample.id : '';
    $('again').textContent = has && s.skipped_before ? '(skipped before)' : '';
    for (const el of [$('sample'), labels, $('skip')]) el.style.display = has ? '' : 'none';
    $('done').style.display = has ? 'none' : 'block';
    document.body.dataset.sample = has ? s.sample.id : '';
    document.body.dataset.labelled = String(p.labelled);
    document.body.dataset.guideline = s.guideline.version;
    document.body.dataset.ready = '1';
  }

  async function act(path, body, done) {
    if (busy || !state) return;
    busy = true;
    try {
      const s = await call('POST', path, body);
      if (s) { render(s); $('status').textContent = done(s); }
    } catch (e) {
      banner(e.message, true);
    } finally {
      busy = false;
    }
  }

  function label(name) {
    if (!state || !state.sample) return;
    const id = state.sample.id;
    // The version shown is the one the annotator read: the label keeps it.
    act('/api/label', { sample: id, label: name, guideline_version: state.guideline.version }, () => 'saved ' + name + ' for ' + id);
  }
  function skip() {
    if (!state || !state.sample) return;
    const id = state.sample.id;
    act('/api/skip', { sample: id }, () => 'skipped ' + id);
  }
  function undo() {
    act('/api/undo', {}, (s) => s.undone ? 'took back ' + s.undone : 'nothing to undo');
  }

  document.addEventListener('keydown', (e) => {
    if (e.ctrlKey || e.metaKey || e.altKey || e.target.tagName === 'INPUT') return;
    if (e.key === ' ') { e.preventDefault(); skip(); return; }
    if (e.key === 'Backspace') { e.preventDefault(); undo(); return; }
    if (!state) return;
    const l = state.labels.find((x) => x.key === e.key) || state.labels.find((x) => x.key.toLowerCase() === e.key.toLowerCase());
    if (l) { e.preventDefault(); label(l.name); }
  });
  $('skip').addEventListener('click', skip);
  $('undo').addEventListener('click', undo);
  $('login').addEventListener('submit', (e) => {
    e.preventDefault();
    token = $('token').value.trim();
    history.replaceState(null, '', location.pathname + '#token=' + encodeURIComponent(token));
    start();
  });

  async function start() {
    if (!token) { showLogin(''); return; }
    try {
      const s = await call('GET', '/api/state');
      if (s) { banner('', false); render(s); }
    } catch (e) {
      banner(e.message, true);
    }
  }
  start();
})();
