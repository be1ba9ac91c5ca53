// The admin UI in a real browser (Debian's headless Chromium driven by playwright-core)
// against the real `bulkhead serve` binary (embedded node, bundled models, SQLite in a temp
// dir), restarted once on the same database to deploy a model whose window its pool cannot
// hold (the publish-gate scenario). Nothing of the platform is mocked. Screenshots go to e2e/artifacts/web/.

import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { fileURLToPath } from "node:url";

import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, "../..");
const BIN = process.env.BULKHEAD_BIN ?? path.join(repo, "target/debug/bulkhead");
const CHROMIUM = process.env.CHROMIUM_PATH ?? "/usr/bin/chromium";
const ARTIFACTS = path.join(repo, "e2e/artifacts/web");

const ADMIN = `e2e-web-admin-${process.pid}`;
const TEXT = "@cf/huggingfacetb/smollm2-135m-instruct";
const EMBED = "@cf/sentence-transformers/all-minilm-l6-v2";
// The 2026 incident in miniature: a catalog window far larger than a serving node's pool.
const INCIDENT = "@cf/bulkhead/smollm2-incident";
const INCIDENT_WINDOW = 1048576;
const POOL = 1024;
const REASON = "Incident drill: stale KV pages served across tenants";

const procs = [];
let data;
let port;
let base;
let browser;
let page;
let acct;
let tenantToken;
const pageErrors = [];

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

function start(name, args, env) {
  const log = fs.openSync(path.join(ARTIFACTS, `${name}.log`), "w");
  const p = spawn(BIN, args, { env: { ...process.env, ...env }, stdio: ["ignore", log, log] });
  p.name = name;
  procs.push(p);
  return p;
}

function stop(p) {
  return new Promise((resolve) => {
    if (p.exitCode !== null || p.signalCode !== null) return resolve();
    const t = setTimeout(() => p.kill("SIGKILL"), 15_000);
    p.once("exit", () => {
      clearTimeout(t);
      resolve();
    });
    p.kill("SIGTERM");
  });
}

let serveRuns = 0;

// The bundled SmolLM2 file: the weights of a model an operator names (`INCIDENT`), which,
// not being a bundled model, must give its GGUF path.
const SMOLLM2_GGUF = path.join(
  process.env.BULKHEAD_MODELS || path.join(os.homedir(), ".cache/bulkhead/models"),
  "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
);

/** `bulkhead serve` on `port` with `data`, its embedded node serving `textModels`. */
function startServe(textModels) {
  serveRuns += 1;
  const config = path.join(data, `serve-${serveRuns}.toml`);
  // A small served window keeps each KV pool small (512 x 2.0 = 1024 tokens).
  const model = (m) =>
    `[[node.text_models]]\nname = "${m}"\ncontext_window = 512\n` +
    (m === TEXT ? "" : `path = ${JSON.stringify(SMOLLM2_GGUF)}\n`);
  fs.writeFileSync(
    config,
    textModels.map(model).join("") + `[[node.embedding_models]]\nname = "${EMBED}"\n`,
  );
  return start(`serve-${serveRuns}`, ["serve", "--config", config], {
    BULKHEAD_ADMIN_TOKEN: ADMIN,
    BULKHEAD_DATA: path.join(data, "db"),
    BULKHEAD_LISTEN: `127.0.0.1:${port}`,
  });
}

async function restartServe(textModels) {
  for (const p of procs) await stop(p);
  await waitHealthy(base, startServe(textModels));
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Retries `fn` until it returns a truthy value (which it returns), or fails after `ms`. */
async function eventually(what, fn, ms = 10_000) {
  const deadline = Date.now() + ms;
  let last;
  for (;;) {
    try {
      const v = await fn();
      if (v) return v;
      last = v;
    } catch (e) {
      last = e;
    }
    if (Date.now() > deadline) assert.fail(`${what} (within ${ms} ms); last: ${last}`);
    await sleep(100);
  }
}

async function waitHealthy(url, p) {
  await eventually(
    `${p.name} answers /health`,
    async () => {
      if (p.exitCode !== null) throw new Error(`${p.name} exited with ${p.exitCode}`);
      const r = await fetch(`${url}/health`);
      return r.ok;
    },
    120_000,
  );
}

async function call(method, urlPath, token, body) {
  const r = await fetch(`${base}${urlPath}`, {
    method,
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await r.text();
  let json;
  try {
    json = JSON.parse(text);
  } catch {
    json = text;
  }
  return { status: r.status, body: json };
}

const admin = (method, urlPath, body) => call(method, `/admin/v1${urlPath}`, ADMIN, body);
const tenantRun = (token, model, body) =>
  call("POST", `/client/v4/accounts/${acct}/ai/run/${model}`, token, body);

let shots = 0;
async function shot(name) {
  shots += 1;
  const file = path.join(ARTIFACTS, `${String(shots).padStart(2, "0")}-${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
}

const nav = (name) => page.getByRole("navigation", { name: "Sections" }).getByRole("link", { name, exact: true });

before(async () => {
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  for (const f of fs.readdirSync(ARTIFACTS)) fs.rmSync(path.join(ARTIFACTS, f));
  assert.ok(fs.existsSync(BIN), `${BIN} is missing: cargo build --bin bulkhead`);
  assert.ok(fs.existsSync(CHROMIUM), `${CHROMIUM} is missing: apt-get install -y chromium`);
  data = fs.mkdtempSync(path.join(os.tmpdir(), "bulkhead-e2e-web-"));
  port = await freePort();
  base = `http://127.0.0.1:${port}`;
  const serve = startServe([TEXT]);
  const launching = chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  await waitHealthy(base, serve);
  browser = await launching;
  const context = await browser.newContext({ viewport: { width: 1360, height: 900 } });
  await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: base });
  page = await context.newPage();
  page.setDefaultTimeout(10_000);
  page.on("pageerror", (e) => pageErrors.push(String(e)));

  // The tenant whose view the UI's changes are checked against, through the tenant API.
  const t = await admin("POST", "/tenants", { name: "acme-e2e" });
  assert.equal(t.status, 200, JSON.stringify(t.body));
  acct = t.body.result.id;
  const k = await admin("POST", `/tenants/${acct}/tokens`, { name: "sdk" });
  assert.equal(k.status, 200, JSON.stringify(k.body));
  tenantToken = k.body.result.token;
});

after(async () => {
  await browser?.close();
  for (const p of procs) await stop(p);
  if (data) fs.rmSync(data, { recursive: true, force: true });
});

describe("admin UI in headless Chromium", () => {
  it("signs in with the admin token, kept in session storage only", async () => {
    await page.goto(`${base}/admin`);
    assert.equal(new URL(page.url()).pathname, "/admin/");
    await page.getByLabel("Admin token").fill("not-the-admin-token");
    await page.getByRole("button", { name: "Sign in" }).click();
    await page.getByRole("alert").filter({ hasText: "The admin token was refused" }).waitFor();
    await shot("sign-in-refused");
    await page.getByLabel("Admin token").fill(ADMIN);
    // Focus is visible: the focused field has a solid outline of at least 2 px.
    const outline = await page.evaluate(() => {
      const s = getComputedStyle(document.activeElement);
      return { style: s.outlineStyle, width: parseFloat(s.outlineWidth) };
    });
    assert.equal(outline.style, "solid");
    assert.ok(outline.width >= 2, JSON.stringify(outline));
    await page.keyboard.press("Enter");
    await page.getByRole("heading", { name: "Model catalog" }).waitFor();
    const stored = await page.evaluate(() => ({
      session: sessionStorage.getItem("bulkhead.adminToken"),
      local: localStorage.length,
      cookie: document.cookie,
    }));
    assert.deepEqual(stored, { session: ADMIN, local: 0, cookie: "" });
  });

  it("keeps the signed-in token and the admin origin out of a hostile tenant worker's reach", async () => {
    // The tenant deploys a worker whose page attacks the operator (hostile-worker.js).
    const wasm = path.join(data, "hostile.wasm");
    execFileSync(BIN, ["worker", "build", path.join(here, "hostile-worker.js"), "-o", wasm], {
      stdio: "inherit",
    });
    const put = await fetch(`${base}/client/v4/accounts/${acct}/workers/scripts/hostile`, {
      method: "PUT",
      headers: { Authorization: `Bearer ${tenantToken}`, "Content-Type": "application/wasm" },
      body: fs.readFileSync(wasm),
    });
    assert.equal(put.status, 200, await put.text());
    // It is served on its own origin only, never under the admin UI's.
    const byPath = await fetch(`${base}/workers/${acct}/hostile/`);
    assert.equal(byPath.status, 404);
    const workerOrigin = `http://hostile.${acct}.workers.localhost:${port}`;

    // The operator is signed in (previous test) when they open the tenant's page.
    const hostile = await page.context().newPage();
    await hostile.goto(`${workerOrigin}/?admin=${encodeURIComponent(base)}`);
    await hostile.click("#go");
    await hostile.waitForFunction(() => window.__results !== undefined, null, { timeout: 15_000 });
    const out = await hostile.evaluate(() => window.__results);
    // Its service worker registers, confined to its own origin ...
    assert.equal(out.sw, `${workerOrigin}/`, JSON.stringify(out));
    // ... the admin window it opened is severed from it (COOP), the frame is refused
    // (frame-ancestors 'none'), and neither yields the token; the admin API does not answer
    // its script.
    assert.equal(out.openedHandleClosed, true, JSON.stringify(out));
    assert.ok(!String(out.openedToken).includes(ADMIN), JSON.stringify(out));
    assert.ok(String(out.framedToken).startsWith("blocked"), JSON.stringify(out));
    assert.notEqual(out.api, 200, JSON.stringify(out));
    for (const p of page.context().pages()) if (p !== page) await p.close();

    // No service worker sits in front of the admin UI: its calls still reach the server.
    await page.reload();
    await page.getByRole("heading", { name: "Model catalog" }).waitFor();
    const sw = await page.evaluate(async () => ({
      registrations: (await navigator.serviceWorker.getRegistrations()).length,
      controlled: navigator.serviceWorker.controller !== null,
      session: sessionStorage.getItem("bulkhead.adminToken") !== null,
    }));
    assert.deepEqual(sw, { registrations: 0, controlled: false, session: true });
  });

  it("takes a model private with a reason; the tenant gets 400; the audit log shows it", async () => {
    const before = await tenantRun(tenantToken, TEXT, { prompt: "hi", max_tokens: 1, temperature: 0 });
    assert.equal(before.status, 200, JSON.stringify(before.body));

    const sw = page.getByRole("switch", { name: `Public: ${TEXT}` });
    assert.equal(await sw.getAttribute("aria-checked"), "true");
    await shot("catalog");

    // Keyboard: Space opens the dialog, Escape closes it without a change, focus comes back.
    await sw.focus();
    await page.keyboard.press("Space");
    const dialog = page.getByRole("dialog", { name: `Make ${TEXT} private` });
    await dialog.waitFor();
    await page.keyboard.press("Escape");
    await dialog.waitFor({ state: "hidden" });
    await eventually(
      "focus returns to the switch",
      async () => (await page.evaluate(() => document.activeElement?.getAttribute("aria-label"))) === `Public: ${TEXT}`,
      2000,
    );
    assert.equal(await sw.getAttribute("aria-checked"), "true");

    await page.keyboard.press("Enter");
    await dialog.waitFor();
    // A reason is required to take a model private.
    await dialog.getByRole("button", { name: "Make private" }).click();
    await dialog.getByRole("alert").filter({ hasText: "Give a reason" }).waitFor();
    await dialog.getByLabel("Reason").fill(REASON);
    await shot("make-private-dialog");
    await dialog.getByRole("button", { name: "Make private" }).click();
    await dialog.waitFor({ state: "hidden" });
    await eventually("the switch shows private", async () => (await sw.getAttribute("aria-checked")) === "false");
    await page.getByRole("status").filter({ hasText: `${TEXT} is now private` }).waitFor();

    // Private means off: the tenant (not on the allow-list) gets 400/5007, within a second.
    const r = await eventually(
      "the tenant gets 400 for the private model",
      async () => {
        const x = await tenantRun(tenantToken, TEXT, { prompt: "hi", max_tokens: 1 });
        return x.status === 400 ? x : null;
      },
      1000,
    );
    assert.equal(r.body.errors[0].code, 5007, JSON.stringify(r.body));

    await nav("Audit log").click();
    await page.getByRole("heading", { name: "Audit log" }).waitFor();
    await page.getByLabel("Model").selectOption(TEXT);
    const first = page.locator("table.audit tbody tr").first();
    await eventually("the newest entry is the visibility change", async () => {
      const text = await first.textContent();
      return text.includes("model.visibility") && text.includes("public → private") && text.includes(REASON);
    });
    assert.match(await first.textContent(), /admin:/);
    assert.match(page.url(), /#\/audit\?model=/);
    await shot("audit-log");
  });

  it("makes it public again and the tenant is served (a real generation)", async () => {
    await nav("Catalog").click();
    const sw = page.getByRole("switch", { name: `Public: ${TEXT}` });
    await eventually("the switch shows private", async () => (await sw.getAttribute("aria-checked")) === "false");
    await sw.click();
    const dialog = page.getByRole("dialog", { name: `Make ${TEXT} public` });
    await dialog.waitFor();
    await dialog.getByLabel("Reason").fill("Drill over");
    await dialog.getByRole("button", { name: "Make public" }).click();
    await dialog.waitFor({ state: "hidden" });
    await eventually("the switch shows public", async () => (await sw.getAttribute("aria-checked")) === "true");

    const r = await tenantRun(tenantToken, TEXT, {
      prompt: "What is the capital of France?",
      temperature: 0,
      max_tokens: 16,
    });
    assert.equal(r.status, 200, JSON.stringify(r.body));
    assert.match(r.body.result.response, /Paris/, r.body.result.response);
  });

  it("loads a model from a GGUF file on the embedded node, then removes it from the node and the catalog", async () => {
    const name = "@cf/bulkhead/smollm2-operator";
    await nav("Catalog").click();
    const form = page.locator("form").filter({ has: page.getByRole("button", { name: "Add model" }) });
    await form.getByLabel("Name", { exact: true }).fill(name);
    await form.getByLabel("Context window (tokens)").fill("256");
    // A file the node cannot load: its refusal, naming the problem, is shown; nothing added.
    await form.getByLabel("GGUF file on the node (optional)").fill("/nonexistent/model.gguf");
    await form.getByRole("button", { name: "Add model" }).click();
    await page.getByRole("alert").filter({ hasText: "source" }).waitFor();
    assert.equal((await admin("GET", "/models")).body.result.some((m) => m.name === name), false);

    await form.getByLabel("GGUF file on the node (optional)").fill(SMOLLM2_GGUF);
    await form.getByRole("button", { name: "Add model" }).click();
    await page.getByRole("status").filter({ hasText: `Created ${name}, served by embedded` }).waitFor();
    const row = page.locator(`tr[data-model="${name}"]`);
    await row.waitFor();
    assert.match(await row.textContent(), /llama architecture/);
    await shot("model-added-from-file");

    await row.getByRole("button", { name: `Remove ${name}` }).click();
    const dialog = page.getByRole("dialog", { name: `Remove ${name}` });
    await dialog.getByRole("button", { name: "Remove" }).click();
    await dialog.waitFor({ state: "hidden" });
    await page.getByRole("status").filter({ hasText: `Removed ${name} from embedded and from the catalog` }).waitFor();
    await row.waitFor({ state: "detached" });
    assert.equal((await admin("GET", "/models")).body.result.some((m) => m.name === name), false);
  });

  it("switches a model's prefix cache off and on; the tenant's repeat is then cold, then cached", async () => {
    // Long enough for a whole page of prompt (16 tokens), with or without a system prompt.
    const body = { prompt: "Name the capital of France, and in one short sentence the river that runs through it.", temperature: 0, max_tokens: 1 };
    const cached = (r) => r.body.result.usage.prompt_tokens_details.cached_tokens;
    const warm = await tenantRun(tenantToken, TEXT, body);
    assert.equal(warm.status, 200, JSON.stringify(warm.body));
    assert.ok(cached(await tenantRun(tenantToken, TEXT, body)) > 0, "the repeat reuses the prompt");

    const sw = page.getByRole("switch", { name: `Prefix cache: ${TEXT}` });
    assert.equal(await sw.getAttribute("aria-checked"), "true");
    await sw.click();
    await page.getByRole("status").filter({ hasText: `Prefix cache of ${TEXT} is now off` }).waitFor();
    await eventually("the switch shows off", async () => (await sw.getAttribute("aria-checked")) === "false");
    const off = await tenantRun(tenantToken, TEXT, body);
    assert.equal(off.status, 200, JSON.stringify(off.body));
    assert.equal(cached(off), 0, JSON.stringify(off.body));

    await sw.click();
    await eventually("the switch shows on", async () => (await sw.getAttribute("aria-checked")) === "true");
    await tenantRun(tenantToken, TEXT, body);
    assert.ok(cached(await tenantRun(tenantToken, TEXT, body)) > 0, "cached again");
    const audit = await admin("GET", `/audit?model=${encodeURIComponent(TEXT)}`);
    assert.equal(audit.body.result.filter((e) => e.action === "model.prefix_cache").length, 2);
  });

  it("shows a model whose node pool is too small as unsafe, with make-public disabled and the numbers", async () => {
    await page.getByLabel("Name", { exact: true }).fill(INCIDENT);
    await page.getByLabel("Context window (tokens)").fill(String(INCIDENT_WINDOW));
    await page.getByLabel("Max output tokens").fill("4096");
    await page.getByLabel("Description").fill("SmolLM2 promised with a 1M window");
    await page.getByRole("button", { name: "Add model" }).click();
    await page.getByRole("status").filter({ hasText: `Created ${INCIDENT}` }).waitFor();

    // A failure of the admin API is a readable message: the same name again is a conflict.
    await page.getByLabel("Name", { exact: true }).fill(INCIDENT);
    await page.getByLabel("Context window (tokens)").fill("8");
    await page.getByRole("button", { name: "Add model" }).click();
    await page.getByRole("alert").filter({ hasText: "HTTP 409" }).waitFor();

    // Deploy it: the control plane restarts with its embedded node also serving the new
    // model, from the same database (the catalog keeps the window the operator gave it).
    await restartServe([TEXT, INCIDENT]);

    await page.getByRole("button", { name: "Refresh" }).click();
    const sw = page.getByRole("switch", { name: `Public: ${INCIDENT}` });
    await eventually("make public is disabled", () => sw.isDisabled());
    const reasonId = await sw.getAttribute("aria-describedby");
    const reason = await page.locator(`[id="${reasonId}"]`).textContent();
    assert.match(reason, /^Make public is disabled: /);
    for (const n of [String(POOL), String(INCIDENT_WINDOW), "2097152"]) {
      assert.ok(reason.includes(n), `${n} in ${reason}`);
    }
    const row = page.locator(`tr[data-model="${INCIDENT}"]`);
    assert.match(await row.textContent(), /Unsafe to publish/);
    assert.match(await row.textContent(), /embedded: pool 1,024 of 2,097,152 tokens needed \(too small\)/);
    await row.scrollIntoViewIfNeeded();
    await shot("catalog-gate-blocked");

    // The API behind the disabled action refuses too.
    const r = await admin("PATCH", `/models/${encodeURIComponent(INCIDENT)}`, { visibility: "public" });
    assert.equal(r.status, 409, JSON.stringify(r.body));
  });

  it("shows nodes with pool bars against window x factor, refreshing on its own", async () => {
    const polls = [];
    const onRequest = (req) => {
      if (req.url().endsWith("/admin/v1/nodes")) polls.push(Date.now());
    };
    page.on("request", onRequest);
    await nav("Nodes").click();
    const embedded = page.locator('article[data-node="embedded"]');
    await embedded.waitFor();
    assert.match(await embedded.textContent(), /healthy/);
    assert.match(await embedded.textContent(), /in-process/);
    const bad = embedded.locator(`tr[data-model="${INCIDENT}"] .fit`);
    assert.match(await bad.getAttribute("class"), /fit-bad/);
    assert.match(await bad.textContent(), /too small: pool 1,024 tokens < 2,097,152 needed/);
    const ok = embedded.locator(`tr[data-model="${TEXT}"] .fit`);
    assert.match(await ok.getAttribute("class"), /fit-ok/);
    assert.match(await ok.textContent(), /fits: pool 1,024 tokens ≥ 1,024 needed/);
    // 1,024 tokens in pages of 16, none in use between requests.
    assert.match(await embedded.locator(`tr[data-model="${TEXT}"]`).textContent(), /0 \/ 64/);
    await shot("nodes");
    await eventually("the nodes page polls again", () => polls.length >= 3, 8000);
    page.off("request", onRequest);
  });

  it("creates a token (shown once, copyable) and revokes it; the revoked token gets 401", async () => {
    await nav("Tenants & tokens").click();
    await page.getByRole("button", { name: "Tokens of acme-e2e" }).click();
    await page.getByLabel("Token name (optional)").fill("browser-made");
    await page.getByRole("button", { name: "Create token" }).click();
    const secretBox = page.getByLabel("Token secret");
    await secretBox.waitFor();
    const secret = await secretBox.inputValue();
    assert.match(secret, /^bh_/);
    await page.getByRole("button", { name: "Copy", exact: true }).click();
    await page.getByRole("status").filter({ hasText: /Copied|Selected/ }).waitFor();
    const copied = await page.evaluate(() => navigator.clipboard.readText().catch(() => null));
    if (copied !== null) assert.equal(copied, secret);
    await shot("token-created");

    const ok = await tenantRun(secret, EMBED, { text: ["hello"] });
    assert.equal(ok.status, 200, JSON.stringify(ok.body));

    const prefix = secret.slice(0, (await page.locator("tr[data-token]").last().getAttribute("data-token")).length);
    await page.getByRole("button", { name: `Revoke token ${prefix}` }).click();
    const dialog = page.getByRole("dialog", { name: `Revoke token ${prefix}…` });
    await dialog.waitFor();
    await dialog.getByRole("button", { name: "Revoke token" }).click();
    await dialog.waitFor({ state: "hidden" });
    await page.locator(`tr[data-token="${prefix}"]`).filter({ hasText: "revoked" }).waitFor();
    assert.equal(await page.getByLabel("Token secret").count(), 0, "the secret is gone once revoked");
    await shot("token-revoked");

    const r = await tenantRun(secret, EMBED, { text: ["hello"] });
    assert.equal(r.status, 401, JSON.stringify(r.body));
    // The other token of the tenant still works.
    assert.equal((await tenantRun(tenantToken, EMBED, { text: ["hello"] })).status, 200);
  });

  it("charts usage per tenant and model, with errors by code, refreshing on its own", async () => {
    // An error counted by its code.
    assert.equal((await tenantRun(tenantToken, EMBED, { text: [] })).status, 400);
    await nav("Usage").click();
    const total = page.locator('dd[data-total="requests"]');
    const count = async () => Number((await total.textContent()).replace(/,/g, ""));
    await eventually("usage shows the requests so far", async () => (await count()) >= 5);
    assert.equal(await page.locator("figure.chart canvas").count(), 2);
    await page.getByRole("heading", { name: "Errors by code" }).waitFor();
    await eventually("the error is listed by its code", async () =>
      (await page.getByRole("region", { name: "Errors by code" }).textContent()).includes("bad_input"),
    );
    await page.getByLabel("Tenant", { exact: true }).selectOption({ label: "acme-e2e" });
    await page.getByLabel("Requests by").selectOption("tenant");
    const n = await count();
    // Live: a new request shows up without a reload.
    assert.equal((await tenantRun(tenantToken, EMBED, { text: ["again"] })).status, 200);
    await eventually("the new request appears", async () => (await count()) > n, 12_000);
    await shot("usage");
  });

  it("shows a readable message, not a blank page, when the control plane goes away; sign-out clears the token", async () => {
    await nav("Nodes").click();
    await page.locator('article[data-node="embedded"]').waitFor();
    for (const p of procs) await stop(p);
    await page.getByRole("alert").filter({ hasText: "Cannot reach the control plane" }).waitFor({ timeout: 15_000 });
    // The last figures stay on screen under the message.
    assert.equal(await page.locator('article[data-node="embedded"]').count(), 1);
    await shot("control-plane-unreachable");

    await page.getByRole("button", { name: "Sign out" }).click();
    await page.getByLabel("Admin token").waitFor();
    assert.equal(await page.evaluate(() => sessionStorage.getItem("bulkhead.adminToken")), null);
    assert.deepEqual(pageErrors, [], "no uncaught errors in the page");
  });
});
