// The aiserve-trio operator console: plain ES module, no framework, no build step.
// Everything it shows comes from /admin/api/* on the same origin; every value is
// put into the page as text, never as HTML.

const TOKEN = "aiserve-console-token";
const WHO = "aiserve-console-key-id";
const POLL_MS = 3000;
const STAGES = ["parse", "context", "inference", "sse"];

const $ = (id) => document.getElementById(id);

const state = {
  version: "",
  writable: false,
  // path -> the steps as the server has them ([{name, kind, enabled}])
  saved: new Map(),
  // path -> the route as the server showed it (name, adapters, models)
  shown: new Map(),
  timer: 0,
};

class ApiError extends Error {
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || null;
  }
}

async function api(method, path, { body, key } = {}) {
  const headers = {};
  const credential = key ?? sessionStorage.getItem(TOKEN);
  if (credential) headers.Authorization = `Bearer ${credential}`;
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  // "overview" is the console's own API (/admin/api/overview); "/admin/keys" the admin API.
  const response = await fetch(path.startsWith("/") ? path : `api/${path}`, init);
  let data = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (!response.ok) {
    throw new ApiError(response.status, (data && data.error) || {});
  }
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === false || value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("data-")) node.dataset[name.slice(5)] = value;
    else if (value === true) node.setAttribute(name, "");
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

const ms = (s) => (s === null || s === undefined ? "-" : `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms`);
const num = (x, digits = 1) => (x === null || x === undefined ? "-" : x.toFixed(digits));
const pct = (x) => (x === null || x === undefined ? "-" : `${(x * 100).toFixed(2)} %`);

function showError(message) {
  $("error").textContent = message || "";
}

// --- login -------------------------------------------------------------------------

function showLogin(message) {
  stopPolling();
  sessionStorage.removeItem(TOKEN);
  $("app").hidden = true;
  $("logout").hidden = true;
  $("who").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("key").focus();
}

async function login(event) {
  event.preventDefault();
  const key = $("key").value.trim();
  $("login-error").textContent = "";
  try {
    const out = await api("POST", "login", { key });
    if (out.token) {
      sessionStorage.setItem(TOKEN, out.token);
      sessionStorage.setItem(WHO, out.key_id);
    }
    $("key").value = "";
    await enter();
  } catch (err) {
    $("login-error").textContent = err.message;
  }
}

async function logout() {
  // The server refuses the token from now on (it would otherwise stay valid until it
  // expires); the tab forgets it whatever the answer.
  let message = "";
  try {
    if (sessionStorage.getItem(TOKEN)) await api("POST", "logout");
  } catch (err) {
    if (err.status !== 401) message = `Log out did not reach the gateway: ${err.message}`;
  }
  sessionStorage.removeItem(TOKEN);
  sessionStorage.removeItem(WHO);
  showLogin(message);
}

async function enter() {
  await loadRoutes();
  const signedIn = Boolean(sessionStorage.getItem(TOKEN));
  $("login").hidden = true;
  $("app").hidden = false;
  $("logout").hidden = !signedIn;
  $("who").textContent = signedIn ? `Signed in as ${sessionStorage.getItem(WHO)}` : "Auth is off: loopback only";
  await refresh();
  startPolling();
}

// --- routes and steps --------------------------------------------------------------

function stepsOf(article) {
  return [...article.querySelectorAll("li.step")].map((li) => ({
    name: li.dataset.name,
    enabled: li.querySelector("input[type=checkbox]").checked,
  }));
}

function dirty(article) {
  const saved = state.saved.get(article.dataset.path) || [];
  const now = stepsOf(article);
  return now.some((s, i) => s.name !== saved[i].name || s.enabled !== saved[i].enabled);
}

function changed(article) {
  const isDirty = dirty(article);
  article.classList.toggle("dirty", isDirty);
  article.querySelector("button.save").disabled = !isDirty || !state.writable;
  article.querySelector("button.revert").disabled = !isDirty;
  say(article, isDirty ? "Not saved yet." : "", "");
}

function say(article, message, kind) {
  const out = article.querySelector(".msg");
  out.textContent = message;
  out.className = `msg ${kind}`;
}

function renumber(ol) {
  const items = [...ol.children];
  items.forEach((li, i) => {
    li.querySelector(".pos").textContent = `${i + 1}`;
    li.querySelector("button.up").disabled = i === 0;
    li.querySelector("button.down").disabled = i === items.length - 1;
  });
}

function stepItem(step) {
  const box = el("input", { type: "checkbox", checked: step.enabled, "aria-label": `${step.name} enabled` });
  const li = el(
    "li",
    { class: "step", draggable: "true", "data-name": step.name },
    el("span", { class: "grip", "aria-hidden": "true", text: "\u2807" }),
    el("span", { class: "pos" }),
    el("span", { class: "name", text: step.name }),
    el("span", { class: "kind", text: step.kind }),
    el("label", { class: "toggle" }, box, " enabled"),
    el("button", { type: "button", class: "up", "aria-label": `Move ${step.name} up`, text: "\u2191" }),
    el("button", { type: "button", class: "down", "aria-label": `Move ${step.name} down`, text: "\u2193" }),
  );
  li.classList.toggle("off", !step.enabled);
  return li;
}

function routeArticle(route) {
  const ol = el("ol", { class: "steps", "aria-label": `Steps of ${route.path}` });
  for (const step of route.steps) ol.append(stepItem(step));
  const article = el(
    "article",
    { class: "route", "data-path": route.path },
    el("h3", {}, el("span", { text: route.name }), " ", el("code", { text: route.path })),
  );
  if (route.adapters && route.adapters.length > 1) {
    const served = Object.entries(route.models).map(([m, a]) => `${m} \u2192 ${a}`).join(", ");
    article.append(el("p", { class: "adapters", text: `Models: ${served}` }));
  }
  if (!route.steps.length) {
    article.append(el("p", { class: "hint", text: "This route has no steps." }));
    return article;
  }
  article.append(
    ol,
    el(
      "div",
      { class: "actions" },
      el("button", { type: "button", class: "save", disabled: true, text: "Save" }),
      el("button", { type: "button", class: "revert", disabled: true, text: "Revert" }),
      el("span", { class: "msg", role: "status" }),
    ),
  );
  renumber(ol);
  wire(article, ol);
  return article;
}

function wire(article, ol) {
  let dragged = null;
  ol.addEventListener("dragstart", (event) => {
    dragged = event.target.closest("li.step");
    if (!dragged) return;
    dragged.classList.add("dragging");
    event.dataTransfer.effectAllowed = "move";
    event.dataTransfer.setData("text/plain", dragged.dataset.name);
  });
  ol.addEventListener("dragover", (event) => {
    if (!dragged) return;
    event.preventDefault();
    event.dataTransfer.dropEffect = "move";
    const others = [...ol.querySelectorAll("li.step:not(.dragging)")];
    const before = others.find((li) => {
      const box = li.getBoundingClientRect();
      return event.clientY < box.top + box.height / 2;
    });
    if (before) {
      if (before !== dragged.nextElementSibling) ol.insertBefore(dragged, before);
    } else if (ol.lastElementChild !== dragged) {
      ol.append(dragged);
    }
  });
  ol.addEventListener("drop", (event) => event.preventDefault());
  ol.addEventListener("dragend", () => {
    if (!dragged) return;
    dragged.classList.remove("dragging");
    dragged = null;
    renumber(ol);
    changed(article);
  });
  ol.addEventListener("click", (event) => {
    const button = event.target.closest("button");
    if (!button) return;
    const li = button.closest("li.step");
    if (button.classList.contains("up") && li.previousElementSibling) {
      ol.insertBefore(li, li.previousElementSibling);
    } else if (button.classList.contains("down") && li.nextElementSibling) {
      ol.insertBefore(li.nextElementSibling, li);
    } else {
      return;
    }
    renumber(ol);
    button.disabled ? li.querySelector("button:not(:disabled)").focus() : button.focus();
    changed(article);
  });
  ol.addEventListener("change", (event) => {
    const li = event.target.closest("li.step");
    if (li) li.classList.toggle("off", !event.target.checked);
    changed(article);
  });
  article.querySelector("button.save").addEventListener("click", () => save(article));
  article.querySelector("button.revert").addEventListener("click", () => {
    const path = article.dataset.path;
    const route = { ...state.shown.get(path), steps: state.saved.get(path) };
    article.replaceWith(routeArticle(route));
  });
}

async function save(article) {
  const path = article.dataset.path;
  const button = article.querySelector("button.save");
  button.disabled = true;
  say(article, "Saving\u2026", "");
  try {
    const out = await api("PUT", "routes/steps", {
      body: { path, version: state.version, steps: stepsOf(article) },
    });
    await loadRoutes({ force: true });
    const fresh = document.querySelector(`article.route[data-path="${CSS.escape(path)}"]`);
    const note = out.unchanged ? "Nothing to change." : `Saved and applied: version ${out.version}.`;
    say(fresh, note, "ok");
  } catch (err) {
    if (err.status === 401) return showLogin("Your console session ended: log in again.");
    const hint = err.status === 409 ? " Revert to see the current steps, then try again." : "";
    say(article, `Refused: ${err.message}${hint}`, "error");
    button.disabled = false;
  }
}

async function loadRoutes({ force = false } = {}) {
  const out = await api("GET", "routes");
  showConfig(out);
  const list = $("route-list");
  const editing = [...list.querySelectorAll("article.route.dirty")].length > 0;
  if (!force && (editing || out.version === state.version) && list.children.length) {
    return;
  }
  state.version = out.version;
  state.writable = out.writable;
  state.saved = new Map(out.routes.map((r) => [r.path, r.steps]));
  state.shown = new Map(out.routes.map((r) => [r.path, r]));
  $("routes-readonly").hidden = out.writable;
  $("routes-readonly").textContent = out.writable ? "" : `Read-only: ${out.reason}`;
  list.replaceChildren(...out.routes.map(routeArticle));
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "-";
}

function showConfig(out) {
  const status = out.reload || {};
  $("config-version").textContent = out.version || "-";
  $("config-loaded").textContent = when(status.loaded_at);
  $("config-by").textContent = status.loaded_by || "-";
  const refused = status.last_refused;
  const box = $("config-refused");
  box.hidden = !refused;
  if (refused) {
    box.textContent = `Last refused reload, by ${refused.by} at ${when(refused.at)}: ${refused.error}`;
  }
}

// --- live numbers ------------------------------------------------------------------

function renderOverview(out) {
  const table = out[$("span").value];
  const rows = table.models.map((m) =>
    el(
      "tr",
      {},
      el("td", { text: m.route }),
      el("td", { text: m.model }),
      el("td", { class: "n", text: `${m.requests}` }),
      el("td", { class: "n", text: num(m.rps, 2) }),
      el("td", { class: "n", text: ms(m.p95_s) }),
      el("td", { class: "n", text: ms(m.ttft_p95_s) }),
      el("td", { class: `n${m.errors ? " bad" : ""}`, text: pct(m.error_rate) }),
      el("td", { class: "n", text: num(m.tokens_per_request) }),
    ),
  );
  if (!rows.length) {
    const span = table.window_s === null ? "yet" : `in the last ${Math.round(table.window_s)} s`;
    rows.push(el("tr", {}, el("td", { colspan: "8", class: "empty", text: `No requests ${span}.` })));
  }
  $("sla-table").tBodies[0].replaceChildren(...rows);
  $("stage-table").tBodies[0].replaceChildren(
    ...table.stages.map((s) =>
      el(
        "tr",
        {},
        el("td", { text: s.stage }),
        el("td", { class: "n", text: ms(s.p99_s) }),
        el("td", { class: "n", text: `${s.runs}` }),
        el("td", { class: "n", text: `${s.live}` }),
      ),
    ),
  );
  $("open-streams").textContent = `${out.open_streams}`;
  $("worker").textContent = `Numbers of worker pid ${out.pid}; each worker keeps its own.`;
}

function renderSlow(out) {
  const rows = out.requests.map((r) =>
    el(
      "tr",
      {},
      el("td", {}, el("code", { text: r.request_id })),
      el("td", { text: r.route }),
      el("td", { text: r.model }),
      el("td", { class: r.outcome === "ok" ? "" : "bad", text: r.outcome }),
      el("td", { class: "n", text: `${r.total_ms.toFixed(1)} ms` }),
      el("td", { class: "n", text: r.ttft_ms === null ? "-" : `${r.ttft_ms.toFixed(1)} ms` }),
      ...STAGES.map((s) =>
        el("td", { class: "n", text: s in r.stages_ms ? r.stages_ms[s].toFixed(1) : "-" }),
      ),
    ),
  );
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "10", class: "empty", text: "No requests yet." })));
  $("slow-table").tBodies[0].replaceChildren(...rows);
}

function renderCache(out) {
  const rows = Object.entries(out.results).map(([route, r]) =>
    el(
      "tr",
      {},
      el("td", { text: route }),
      ...["hit", "semantic_hit", "miss", "coalesced", "bypass"].map((k) =>
        el("td", { class: "n", text: `${r[k] || 0}` }),
      ),
    ),
  );
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "6", class: "empty", text: "No cached route has been asked yet." })));
  $("cache-table").tBodies[0].replaceChildren(...rows);
  $("cache-entries").textContent = `${out.semantic_entries}`;
  const sim = out.similarity;
  const most = Math.max(1, ...sim.le.map((_, i) => sim.hit[i] + sim.miss[i]));
  const buckets = sim.le
    .map((le, i) =>
      el(
        "tr",
        {},
        el("td", { text: le === null ? "1+" : le.toFixed(2) }),
        el("td", { class: "n", text: `${sim.hit[i]}` }),
        el("td", { class: "n", text: `${sim.miss[i]}` }),
        el("td", {}, el("meter", { min: "0", max: `${most}`, value: `${sim.hit[i] + sim.miss[i]}` })),
      ),
    )
    .filter((_, i) => sim.hit[i] + sim.miss[i] > 0);
  if (!buckets.length) buckets.push(el("tr", {}, el("td", { colspan: "4", class: "empty", text: "No semantic lookup found a stored question yet." })));
  $("similarity-table").tBodies[0].replaceChildren(...buckets);
  const hits = out.recent.map((h) =>
    el(
      "tr",
      {},
      el("td", { text: new Date(h.at * 1000).toLocaleTimeString() }),
      el("td", { text: h.route }),
      el("td", { class: "n", text: h.similarity.toFixed(4) }),
      el("td", { class: "question", text: h.asked }),
      el("td", { class: "question", text: h.stored }),
    ),
  );
  if (!hits.length) hits.push(el("tr", {}, el("td", { colspan: "5", class: "empty", text: "No semantic hits yet." })));
  $("semantic-hits").tBodies[0].replaceChildren(...hits);
}

const money = (x) => (x === null || x === undefined ? "-" : x.toFixed(x > 0 && x < 0.01 ? 6 : 4));

function svg(tag, attrs = {}, text = "") {
  // The chart's own namespace (the <svg> is in the page): no URL written here.
  const node = document.createElementNS($("spend-chart").namespaceURI, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, `${value}`);
  if (text) node.textContent = text;
  return node;
}

// One bar per day of the last 30 (UTC), drawn as inline SVG: nothing loaded from elsewhere.
function renderChart(days, currency) {
  const byDay = new Map(days.map((d) => [d.group, d]));
  const today = new Date();
  const dates = [];
  for (let i = 29; i >= 0; i -= 1) {
    const d = new Date(Date.UTC(today.getUTCFullYear(), today.getUTCMonth(), today.getUTCDate() - i));
    dates.push(d.toISOString().slice(0, 10));
  }
  const max = Math.max(0, ...dates.map((d) => (byDay.get(d) || { cost: 0 }).cost));
  const width = 600 / dates.length;
  const bars = dates.map((day, i) => {
    const entry = byDay.get(day) || { cost: 0, requests: 0 };
    const h = max > 0 ? (entry.cost / max) * 140 : 0;
    const bar = svg("rect", {
      class: "bar", x: i * width + 1, y: 150 - h, width: width - 2, height: h, "data-day": day,
    });
    bar.append(svg("title", {}, `${day}: ${money(entry.cost)} ${currency}, ${entry.requests} requests`));
    return bar;
  });
  const axis = svg("line", { class: "axis", x1: 0, y1: 150, x2: 600, y2: 150 });
  const label = svg("text", { class: "max", x: 4, y: 12 }, max > 0 ? `${money(max)} ${currency}` : "no spend yet");
  $("spend-chart").replaceChildren(axis, ...bars, label);
}

function spendRows(id, groups, empty) {
  const rows = groups.map((g) =>
    el(
      "tr",
      {},
      el("td", { text: g.group || "(none)" }),
      el("td", { class: "n", text: `${g.requests}` }),
      el("td", { class: "n", text: `${g.prompt_tokens + g.completion_tokens}` }),
      el("td", { class: "n", text: `${g.cache_read_tokens} / ${g.cache_write_tokens}` }),
      el("td", { class: "n", text: money(g.cost) }),
      el("td", { class: "n", text: money(g.cache_cost) }),
      el("td", { class: "n", text: money(g.saved) }),
    ),
  );
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "7", class: "empty", text: empty })));
  $(id).tBodies[0].replaceChildren(...rows);
}

function renderSpend(out) {
  $("spend-currency").textContent = `(${out.currency})`;
  $("spend-off").hidden = out.audit;
  renderChart(out.days, out.currency);
  spendRows("spend-tenants", out.tenants, "No spend yet.");
  spendRows("spend-keys", out.keys, "No spend yet.");
  spendRows("spend-models", out.models, "No spend yet.");
  const rows = out.budgets.map((b) =>
    el(
      "tr",
      { class: b.ratio >= 1 ? "bad" : b.ratio >= b.alert_at ? "warn" : "" },
      el("td", { text: `${b.scope} ${b.name}` }),
      el("td", { text: b.period }),
      el("td", { class: "n", text: money(b.amount) }),
      el("td", { class: "n", text: money(b.spent) }),
      el("td", { class: "n" }, el("meter", { min: "0", max: "1", low: `${b.alert_at}`, high: `${b.alert_at}`, optimum: "0", value: `${Math.min(b.ratio, 1)}` }), ` ${pct(b.ratio)}`),
      el("td", { text: b.resets_at ?? "never" }),
    ),
  );
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "6", class: "empty", text: "No budgets configured." })));
  $("budgets").tBodies[0].replaceChildren(...rows);
}

// --- API keys and the admin audit trail (the audit database's, issue 47) -----------------

const at = (t) => (t === null || t === undefined ? "-" : new Date(t * 1000).toISOString().slice(0, 19).replace("T", " "));

// A section this sign-in's role may not read (403) stays hidden.
async function optional(section, read) {
  try {
    await read();
    $(section).hidden = false;
  } catch (err) {
    if (err.status === 403) $(section).hidden = true;
    else throw err;
  }
}

function keyState(k) {
  if (k.revoked_at !== null) return `revoked ${at(k.revoked_at)}`;
  if (k.expires_at !== null && k.expires_at * 1000 <= Date.now()) return "expired";
  if (k.old_secret_valid_until !== null) return `rotated; old secret until ${at(k.old_secret_valid_until)}`;
  return "active";
}

function keyRow(k) {
  const actions = el("td", { class: "actions" });
  if (k.revoked_at === null) {
    const rotate = el("button", { type: "button", class: "rotate", text: "Rotate",
      title: "A new secret; the old one stays valid for an hour" });
    rotate.addEventListener("click", () => keyAction(k.id, "rotate", { grace_s: 3600 }));
    // Two clicks: a revoked key cannot be brought back.
    const revoke = el("button", { type: "button", class: "revoke", text: "Revoke" });
    revoke.addEventListener("click", () => {
      if (revoke.dataset.armed) return keyAction(k.id, "revoke", {});
      revoke.dataset.armed = "1";
      revoke.textContent = "Confirm revoke";
    });
    actions.append(rotate, " ", revoke);
  }
  return el(
    "tr",
    { "data-id": k.id, class: k.revoked_at !== null ? "off" : "" },
    el("td", {}, el("code", { text: k.id })),
    el("td", { text: k.label || "" }),
    el("td", { text: k.tenant }),
    el("td", { text: k.team || "" }),
    el("td", { text: k.models ? k.models.join(", ") : "all" }),
    el("td", { class: "n", text: k.budget === null || k.budget === undefined ? "-" : `${money(k.budget)} / ${k.budget_period}` }),
    el("td", { text: k.expires_at === null ? "never" : at(k.expires_at) }),
    el("td", { text: at(k.last_used) }),
    el("td", { class: "state", text: keyState(k) }),
    actions,
  );
}

async function loadKeys() {
  const out = await api("GET", "/admin/keys?revoked=1&limit=500");
  const rows = out.keys.map(keyRow);
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "10", class: "empty", text: "No keys yet." })));
  $("keys-table").tBodies[0].replaceChildren(...rows);
}

function showSecret(what, key) {
  $("key-secret-what").textContent = what;
  $("key-secret-value").textContent = key;
  $("key-secret").hidden = false;
}

async function keyAction(id, action, body) {
  $("keys-error").textContent = "";
  try {
    const out = await api("POST", `/admin/keys/${encodeURIComponent(id)}/${action}`, { body });
    if (out.key) showSecret(`New secret of ${id}:`, out.key);
    await Promise.all([loadKeys(), loadAudit()]);
  } catch (err) {
    $("keys-error").textContent = err.message;
  }
}

async function createKey(event) {
  event.preventDefault();
  $("keys-error").textContent = "";
  const body = { label: $("key-label").value.trim() };
  for (const field of ["tenant", "team"]) {
    const value = $(`key-${field}`).value.trim();
    if (value) body[field] = value;
  }
  const models = $("key-models").value.split(",").map((m) => m.trim()).filter(Boolean);
  if (models.length) body.models = models;
  if ($("key-budget").value !== "") body.budget = Number($("key-budget").value);
  if ($("key-days").value !== "") body.expires_at = Date.now() / 1000 + Number($("key-days").value) * 86400;
  try {
    const out = await api("POST", "/admin/keys", { body });
    showSecret(`New key ${out.id}:`, out.key);
    $("key-form").reset();
    await Promise.all([loadKeys(), loadAudit()]);
  } catch (err) {
    $("keys-error").textContent = err.message;
  }
}

async function loadAudit() {
  const query = new URLSearchParams({ limit: "100" });
  for (const field of ["actor", "action", "target"]) {
    const value = $(`audit-${field}`).value.trim();
    if (value) query.set(field, value);
  }
  const out = await api("GET", `/admin/audit?${query}`);
  const rows = out.rows.map((r) =>
    el(
      "tr",
      {},
      el("td", { text: at(r.ts) }),
      el("td", { text: r.actor }),
      el("td", { text: r.client || "-" }),
      el("td", { text: r.tenant || "" }),
      el("td", { text: r.action }),
      el("td", {}, el("code", { text: r.target || "" })),
      el("td", { class: "detail", text: JSON.stringify(r.detail) }),
    ),
  );
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "7", class: "empty", text: "No admin actions in the last 7 days." })));
  $("audit-table").tBodies[0].replaceChildren(...rows);
}

// --- MCP servers (issue 52): their state, tools and the recent tool calls ---------------

function renderMcp(out) {
  const servers = Object.entries(out.servers).map(([name, s]) => {
    const tools = el("details", {}, el("summary", { text: `${s.tools}` }), el("span", { text: s.tool_names.join(", ") }));
    const tenants = Object.entries(s.tenants || {}).map(([t, state]) => `${t}: ${state}`).join(", ");
    return el(
      "tr",
      { "data-server": name, class: s.state === "ready" ? "" : "bad" },
      el("td", {}, el("code", { text: name })),
      el("td", { class: "state", text: s.state }),
      el("td", { text: s.transport }),
      el("td", { class: "n" }, tools),
      el("td", { class: "n", text: `${s.restarts}` }),
      el("td", { text: tenants || "-" }),
      el("td", { class: "detail", text: s.error || "" }),
    );
  });
  $("mcp-servers").tBodies[0].replaceChildren(...servers);
  const calls = out.calls.slice(0, 50).map((c) =>
    el(
      "tr",
      { class: c.status === "ok" ? "" : "bad" },
      el("td", { text: at(c.ts) }),
      el("td", { text: c.key_id || "-" }),
      el("td", { text: c.tenant }),
      el("td", {}, el("code", { text: `${c.server}__${c.tool}` })),
      el("td", { class: "state", text: c.status }),
      el("td", { class: "n", text: `${c.ms.toFixed(1)} ms` }),
      el("td", { class: "n", text: `${c.bytes}` }),
    ),
  );
  if (!calls.length) calls.push(el("tr", {}, el("td", { colspan: "7", class: "empty", text: "No tool calls yet." })));
  $("mcp-calls").tBodies[0].replaceChildren(...calls);
}

async function loadMcp(overview) {
  $("mcp").hidden = !overview.mcp;
  if (overview.mcp) renderMcp(await api("GET", "/admin/mcp"));
}

// Keys and the audit trail live in the audit database: without one the gateway has no
// such endpoints and the sections stay hidden.
async function loadAdmin(overview) {
  if (!overview.keys) return;
  await Promise.all([optional("keys", loadKeys), optional("audit", loadAudit)]);
}

let last = null;
let polls = 0;

async function refresh() {
  try {
    const [overview, slow, cache] = await Promise.all([
      api("GET", "overview"),
      api("GET", "slow"),
      api("GET", "cache"),
    ]);
    last = overview;
    renderOverview(overview);
    renderSlow(slow);
    renderCache(cache);
    await loadMcp(overview);
    // Spend is read from the audit database: every fifth poll is enough.
    if (polls % 5 === 0) {
      renderSpend(await api("GET", "spend"));
      await loadAdmin(overview);
    }
    polls += 1;
    await loadRoutes();
    showError("");
  } catch (err) {
    if (err.status === 401) return showLogin("Your console session ended: log in again.");
    showError(`Could not refresh: ${err.message}`);
  }
}

function startPolling() {
  stopPolling();
  state.timer = setInterval(refresh, POLL_MS);
}

function stopPolling() {
  if (state.timer) clearInterval(state.timer);
  state.timer = 0;
}

async function start() {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  $("span").addEventListener("change", () => last && renderOverview(last));
  $("key-form").addEventListener("submit", createKey);
  $("audit-form").addEventListener("submit", (event) => {
    event.preventDefault();
    loadAudit().catch((err) => showError(err.message));
  });
  try {
    // With a token from earlier in this tab, or with auth off on loopback, no login.
    await enter();
  } catch (err) {
    if (err.status === 401) showLogin("");
    else if (err.status === 403) showLogin(err.message);
    else showError(err.message);
  }
}

start();
