// The UI's own logic, free of the DOM so that Vitest checks it directly.

import type { AuditEntry, Model, NodeModel, PoolStats, Tenant, UsageRow, Visibility } from "./types";

// ---------------------------------------------------------------- formatting

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

export function formatInt(n: number | null | undefined): string {
  return n === null || n === undefined || Number.isNaN(n) ? "—" : integer.format(n);
}

/** `2026-03-01 14:05:09 UTC` */
export function formatTime(ms: number): string {
  if (!Number.isFinite(ms) || ms <= 0) return "—";
  const d = new Date(ms);
  const p = (n: number) => String(n).padStart(2, "0");
  return (
    `${d.getUTCFullYear()}-${p(d.getUTCMonth() + 1)}-${p(d.getUTCDate())} ` +
    `${p(d.getUTCHours())}:${p(d.getUTCMinutes())}:${p(d.getUTCSeconds())} UTC`
  );
}

export function relativeTime(ms: number, now: number): string {
  if (!Number.isFinite(ms) || ms <= 0) return "never";
  const s = Math.round((now - ms) / 1000);
  if (s < 2) return "just now";
  if (s < 60) return `${s} s ago`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ago`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h} h ago`;
  return `${Math.floor(h / 24)} d ago`;
}

// ---------------------------------------------------------------- API failures

export interface Failure {
  message: string;
  code?: number;
}

/**
 * A readable message for a failed admin API call: the envelope's own message and code
 * when there is one, else what the HTTP status means. Status 0: the server was not reached.
 */
export function describeFailure(status: number, statusText: string, body: unknown): Failure {
  if (status === 0) {
    const detail = typeof body === "string" && body ? ` (${body})` : "";
    return { message: `Cannot reach the control plane${detail}. Is bulkhead serve running?` };
  }
  const errors = (body as { errors?: { code?: number; message?: string }[] } | null)?.errors;
  const first = Array.isArray(errors) ? errors[0] : undefined;
  if (first?.message) {
    const code = typeof first.code === "number" ? first.code : undefined;
    const prefix = status === 401 ? "The admin token was refused: " : "";
    return {
      message: `${prefix}${first.message} (HTTP ${status}${code !== undefined ? `, code ${code}` : ""})`,
      code,
    };
  }
  const generic: Record<number, string> = {
    400: "The request was not accepted",
    401: "The admin token was refused",
    403: "This token may not do that",
    404: "Not found",
    409: "Conflict",
    413: "The request is too large",
    429: "Too many requests; try again shortly",
    500: "The control plane failed",
    502: "Bad gateway",
    503: "The control plane is unavailable",
  };
  const what = generic[status] ?? (statusText || "Request failed");
  return { message: `${what} (HTTP ${status})` };
}

// ---------------------------------------------------------------- routing

export const PAGES = ["catalog", "nodes", "tenants", "usage", "audit"] as const;
export type Page = (typeof PAGES)[number];

export interface Route {
  page: Page;
  params: URLSearchParams;
}

/** `#/audit?model=x` → {page: "audit", params: model=x}; anything else → the catalog. */
export function parseRoute(hash: string): Route {
  const raw = hash.replace(/^#\/?/, "");
  const [path = "", q = ""] = raw.split("?", 2);
  const page = (PAGES as readonly string[]).includes(path) ? (path as Page) : "catalog";
  return { page, params: new URLSearchParams(q) };
}

export function routeHref(page: Page, params: Record<string, string | undefined> = {}): string {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v) q.set(k, v);
  const s = q.toString();
  return `#/${page}${s ? `?${s}` : ""}`;
}

// ---------------------------------------------------------------- the publish gate

export type GateState = "fits" | "blocked" | "unserved";

export interface GateSummary {
  state: GateState;
  /** One line for the catalog table. */
  text: string;
  /** Per serving node, with the numbers. */
  details: string[];
}

export function gateSummary(m: Model): GateSummary {
  const details = m.nodes.map((n) => {
    if (n.pool_tokens === undefined || n.pool_tokens === null) {
      return `${n.node}: ${n.fits ? "fits" : n.reason ?? "does not fit"}`;
    }
    const verdict = n.fits ? "fits" : "too small";
    return `${n.node}: pool ${formatInt(n.pool_tokens)} of ${formatInt(n.required_tokens)} tokens needed (${verdict})`;
  });
  if (!m.publishable) {
    return {
      state: "blocked",
      text: m.publish_blocked_reason ?? "A serving node's KV pool is too small for this model",
      details,
    };
  }
  if (m.nodes.length === 0) {
    return { state: "unserved", text: "No node serves this model yet", details };
  }
  const n = m.nodes.length;
  return { state: "fits", text: `Fits on ${n === 1 ? "its serving node" : `all ${n} serving nodes`}`, details };
}

/** Whether the visibility switch may be flipped, and if not, why. */
export function toggleBlock(m: Model): string | null {
  if (m.visibility === "private" && !m.publishable) {
    return `Make public is disabled: ${m.publish_blocked_reason ?? "a serving node's pool is too small"}`;
  }
  return null;
}

export interface PoolBar {
  fits: boolean;
  /** Bar length: pool capacity as a share of what the model needs, 0..100. */
  percent: number;
  label: string;
}

export function poolBar(m: NodeModel): PoolBar | null {
  if (!m.pool || m.required_pool_tokens === null || m.required_pool_tokens === undefined) return null;
  const cap = m.pool.capacity_tokens;
  const req = m.required_pool_tokens;
  const percent = req <= 0 ? 100 : Math.min(100, Math.round((cap / req) * 1000) / 10);
  const fits = cap >= req;
  return {
    fits,
    percent,
    label: `pool ${formatInt(cap)} tokens ${fits ? "≥" : "<"} ${formatInt(req)} needed (context window ${formatInt(m.context_window)} × safety factor)`,
  };
}

export interface PageUse {
  used: number;
  free: number;
  total: number;
  percent: number;
}

export function pageUse(p: PoolStats): PageUse {
  const used = Math.max(0, p.pages_total - p.pages_free);
  return {
    used,
    free: p.pages_free,
    total: p.pages_total,
    percent: p.pages_total > 0 ? Math.round((used / p.pages_total) * 1000) / 10 : 0,
  };
}

// ---------------------------------------------------------------- visibility changes

export interface VisibilityChange {
  visibility: Visibility;
  reason?: string;
  allow?: string[];
}

/** The PATCH body for a visibility change, or a message saying what is missing. */
export function visibilityChange(
  target: Visibility,
  reason: string,
  allow: string[],
): { body: VisibilityChange } | { error: string } {
  const r = reason.trim();
  if (target === "private") {
    if (!r) return { error: "Give a reason for taking the model private; it goes into the audit log." };
    return { body: { visibility: "private", reason: r, allow: [...new Set(allow)] } };
  }
  return { body: r ? { visibility: "public", reason: r, allow: [] } : { visibility: "public", allow: [] } };
}

// ---------------------------------------------------------------- model form

export interface ModelForm {
  name: string;
  task: string;
  context_window: string;
  max_output_tokens: string;
  description: string;
  /** A GGUF file on `node`'s machine, loaded there now; empty: a catalog entry only. */
  path: string;
  /** `embedded` or a remote node's id. */
  node: string;
}

export function parseModelForm(
  f: ModelForm,
): { body: Record<string, unknown> } | { error: string } {
  const name = f.name.trim();
  if (!/^@[^/\s]+\/[^/\s]+\/\S+$/.test(name)) {
    return { error: "Model names look like @cf/author/name." };
  }
  const path = f.path.trim();
  // With a file, the node reports the model's own window unless a smaller one is asked for.
  const window = path !== "" && f.context_window.trim() === "" ? undefined : Number(f.context_window);
  if (window !== undefined && (!Number.isInteger(window) || window < 1)) {
    return { error: "The context window is a whole number of tokens, at least 1." };
  }
  if (path !== "" && f.task !== "text-generation") {
    return { error: "Only text-generation models load from a GGUF file." };
  }
  if (path !== "" && !path.startsWith("/")) {
    return { error: "The GGUF path is absolute, on the node's machine." };
  }
  const maxOut = f.max_output_tokens.trim() === "" ? 0 : Number(f.max_output_tokens);
  if (!Number.isInteger(maxOut) || maxOut < 0) {
    return { error: "Max output tokens is a whole number, 0 or more." };
  }
  const body: Record<string, unknown> = {
    name,
    task: f.task,
    max_output_tokens: maxOut,
    description: f.description.trim(),
  };
  if (window !== undefined) body.context_window = window;
  if (path !== "") body.source = { node: f.node.trim() || "embedded", path };
  return { body };
}

// ---------------------------------------------------------------- usage

/** The `n` UTC days ending with `today` (YYYY-MM-DD), oldest first. */
export function dayRange(today: string, n: number): string[] {
  const end = Date.parse(`${today}T00:00:00Z`);
  const out: string[] = [];
  for (let i = n - 1; i >= 0; i--) {
    out.push(new Date(end - i * 86_400_000).toISOString().slice(0, 10));
  }
  return out;
}

export function utcToday(now: number): string {
  return new Date(now).toISOString().slice(0, 10);
}

export type GroupBy = "model" | "tenant";

export interface Series {
  key: string;
  requests: number[];
  inputTokens: number[];
  outputTokens: number[];
}

export interface UsageSeries {
  labels: string[];
  series: Series[];
}

/** Per-day series for the charts, one per model or tenant, zero-filled over the range. */
export function usageSeries(rows: UsageRow[], days: string[], groupBy: GroupBy): UsageSeries {
  const index = new Map(days.map((d, i) => [d, i]));
  const byKey = new Map<string, Series>();
  for (const r of rows) {
    const i = index.get(r.day);
    if (i === undefined) continue;
    const key = groupBy === "model" ? r.model : r.tenant_id;
    let s = byKey.get(key);
    if (!s) {
      s = {
        key,
        requests: days.map(() => 0),
        inputTokens: days.map(() => 0),
        outputTokens: days.map(() => 0),
      };
      byKey.set(key, s);
    }
    s.requests[i] = (s.requests[i] ?? 0) + r.requests;
    s.inputTokens[i] = (s.inputTokens[i] ?? 0) + r.input_tokens;
    s.outputTokens[i] = (s.outputTokens[i] ?? 0) + r.output_tokens;
  }
  const series = [...byKey.values()].sort((a, b) => a.key.localeCompare(b.key));
  return { labels: days, series };
}

export interface Totals {
  requests: number;
  inputTokens: number;
  outputTokens: number;
  errors: number;
}

export function usageTotals(rows: UsageRow[]): Totals {
  const t: Totals = { requests: 0, inputTokens: 0, outputTokens: 0, errors: 0 };
  for (const r of rows) {
    t.requests += r.requests;
    t.inputTokens += r.input_tokens;
    t.outputTokens += r.output_tokens;
    for (const c of Object.values(r.errors)) t.errors += c;
  }
  return t;
}

/** Error counts by code, most frequent first. */
export function errorsByCode(rows: UsageRow[]): { code: string; count: number }[] {
  const m = new Map<string, number>();
  for (const r of rows) {
    for (const [code, n] of Object.entries(r.errors)) m.set(code, (m.get(code) ?? 0) + n);
  }
  return [...m.entries()]
    .map(([code, count]) => ({ code, count }))
    .sort((a, b) => b.count - a.count || a.code.localeCompare(b.code));
}

export interface UsageByPair {
  tenant_id: string;
  model: string;
  requests: number;
  inputTokens: number;
  outputTokens: number;
  errors: number;
}

/** Rows summed over the days, per tenant and model, busiest first. */
export function usageByPair(rows: UsageRow[]): UsageByPair[] {
  const m = new Map<string, UsageByPair>();
  for (const r of rows) {
    const k = `${r.tenant_id}\u0000${r.model}`;
    const e = m.get(k) ?? {
      tenant_id: r.tenant_id,
      model: r.model,
      requests: 0,
      inputTokens: 0,
      outputTokens: 0,
      errors: 0,
    };
    e.requests += r.requests;
    e.inputTokens += r.input_tokens;
    e.outputTokens += r.output_tokens;
    for (const c of Object.values(r.errors)) e.errors += c;
    m.set(k, e);
  }
  return [...m.values()].sort(
    (a, b) => b.requests - a.requests || a.tenant_id.localeCompare(b.tenant_id) || a.model.localeCompare(b.model),
  );
}

export function tenantLabel(id: string, tenants: Tenant[]): string {
  const t = tenants.find((x) => x.id === id);
  return t ? t.name : id;
}

// ---------------------------------------------------------------- audit log

function str(v: unknown): string | undefined {
  return typeof v === "string" ? v : undefined;
}

/** One line saying what an audit entry changed. */
export function describeAudit(e: AuditEntry, tenants: Tenant[] = []): string {
  const a = e.after ?? {};
  const b = e.before ?? {};
  switch (e.action) {
    case "model.visibility": {
      const from = str(b.visibility) ?? "?";
      const to = str(a.visibility) ?? "?";
      const parts = [from === to ? `stays ${to}` : `${from} → ${to}`];
      const reason = str(a.visibility_reason);
      if (reason) parts.push(`reason: “${reason}”`);
      const allow = Array.isArray(a.allow) ? (a.allow as string[]) : [];
      if (to === "private" && allow.length) {
        parts.push(`allow-list: ${allow.map((id) => tenantLabel(id, tenants)).join(", ")}`);
      }
      return parts.join("; ");
    }
    case "model.prefix_cache":
      return `prefix cache ${a.prefix_cache === false ? "off" : "on"}`;
    case "model.create":
    case "model.register":
      return `${e.action === "model.create" ? "created" : "registered"} (${str(a.task) ?? "?"}, context window ${formatInt(
        typeof a.context_window === "number" ? a.context_window : NaN,
      )}, ${str(a.visibility) ?? "private"})`;
    case "tenant.create":
      return `tenant “${str(a.name) ?? e.target}” created`;
    case "token.create":
      return `token ${str(a.prefix) ?? ""}… created${str(a.name) ? ` (“${str(a.name)}”)` : ""} for ${tenantLabel(
        str(a.tenant) ?? e.target,
        tenants,
      )}`;
    case "token.revoke":
      return `token revoked${str(a.tenant) ? ` (tenant ${tenantLabel(str(a.tenant)!, tenants)})` : ""}`;
    case "node.register":
      return `node registered at ${str(a.address) ?? "?"}`;
    default:
      return e.action;
  }
}
