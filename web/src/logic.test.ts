import { describe, expect, it } from "vitest";

import {
  dayRange,
  describeAudit,
  describeFailure,
  errorsByCode,
  formatInt,
  formatTime,
  gateSummary,
  pageUse,
  parseModelForm,
  parseRoute,
  poolBar,
  relativeTime,
  routeHref,
  toggleBlock,
  usageByPair,
  usageSeries,
  usageTotals,
  visibilityChange,
} from "./logic";
import type { AuditEntry, Model, UsageRow } from "./types";

function model(over: Partial<Model> = {}): Model {
  return {
    name: "@cf/a/b",
    task: "text-generation",
    description: "",
    context_window: 8192,
    max_output_tokens: 2048,
    visibility: "public",
    visibility_reason: null,
    prefix_cache: true,
    allow: [],
    properties: {},
    created_at: 1,
    updated_at: 1,
    nodes: [{ node: "embedded", pool_tokens: 16384, required_tokens: 16384, fits: true, reason: null }],
    publishable: true,
    publish_blocked_reason: null,
    ...over,
  };
}

describe("formatting", () => {
  it("groups thousands and marks missing numbers", () => {
    expect(formatInt(1048576)).toBe("1,048,576");
    expect(formatInt(null)).toBe("—");
    expect(formatInt(NaN)).toBe("—");
  });
  it("formats UTC times", () => {
    expect(formatTime(Date.UTC(2026, 2, 1, 14, 5, 9))).toBe("2026-03-01 14:05:09 UTC");
    expect(formatTime(0)).toBe("—");
  });
  it("says how long ago", () => {
    const now = 1_000_000_000;
    expect(relativeTime(now - 500, now)).toBe("just now");
    expect(relativeTime(now - 5_000, now)).toBe("5 s ago");
    expect(relativeTime(now - 3 * 60_000, now)).toBe("3 min ago");
    expect(relativeTime(now - 5 * 3_600_000, now)).toBe("5 h ago");
    expect(relativeTime(now - 3 * 86_400_000, now)).toBe("3 d ago");
    expect(relativeTime(0, now)).toBe("never");
  });
});

describe("describeFailure", () => {
  it("uses the envelope's message and code", () => {
    const f = describeFailure(409, "Conflict", {
      success: false,
      errors: [{ code: 3040, message: "cannot make x public: pool too small" }],
    });
    expect(f.message).toBe("cannot make x public: pool too small (HTTP 409, code 3040)");
    expect(f.code).toBe(3040);
  });
  it("explains a refused token", () => {
    const f = describeFailure(401, "Unauthorized", { errors: [{ code: 10000, message: "Authentication error" }] });
    expect(f.message).toMatch(/^The admin token was refused: Authentication error/);
  });
  it("falls back to the status without an envelope", () => {
    expect(describeFailure(502, "Bad Gateway", "<html>").message).toBe("Bad gateway (HTTP 502)");
    expect(describeFailure(418, "I'm a teapot", undefined).message).toBe("I'm a teapot (HTTP 418)");
  });
  it("says when the server cannot be reached", () => {
    expect(describeFailure(0, "", "Failed to fetch").message).toBe(
      "Cannot reach the control plane (Failed to fetch). Is bulkhead serve running?",
    );
  });
});

describe("routes", () => {
  it("parses pages and parameters", () => {
    const r = parseRoute("#/audit?model=%40cf%2Fa%2Fb&tenant=t1");
    expect(r.page).toBe("audit");
    expect(r.params.get("model")).toBe("@cf/a/b");
    expect(r.params.get("tenant")).toBe("t1");
  });
  it("defaults to the catalog", () => {
    expect(parseRoute("").page).toBe("catalog");
    expect(parseRoute("#/nope").page).toBe("catalog");
  });
  it("round-trips", () => {
    const href = routeHref("audit", { model: "@cf/a/b", tenant: undefined });
    expect(href).toBe("#/audit?model=%40cf%2Fa%2Fb");
    expect(parseRoute(href).params.get("model")).toBe("@cf/a/b");
  });
});

describe("publish gate", () => {
  it("a fitting model can be toggled", () => {
    const m = model();
    expect(gateSummary(m).state).toBe("fits");
    expect(gateSummary(m).details).toEqual(["embedded: pool 16,384 of 16,384 tokens needed (fits)"]);
    expect(toggleBlock(m)).toBeNull();
  });
  it("a blocked private model cannot be made public, with the reason", () => {
    const reason = "node edge pool of 1024 tokens is smaller than context window 1048576 x safety factor 2 = 2097152";
    const m = model({
      visibility: "private",
      publishable: false,
      publish_blocked_reason: reason,
      nodes: [{ node: "edge", pool_tokens: 1024, required_tokens: 2097152, fits: false, reason }],
    });
    const g = gateSummary(m);
    expect(g.state).toBe("blocked");
    expect(g.text).toBe(reason);
    expect(g.details).toEqual(["edge: pool 1,024 of 2,097,152 tokens needed (too small)"]);
    expect(toggleBlock(m)).toBe(`Make public is disabled: ${reason}`);
  });
  it("a blocked public model can still be taken private", () => {
    expect(toggleBlock(model({ publishable: false, publish_blocked_reason: "x" }))).toBeNull();
  });
  it("a model no node serves says so", () => {
    expect(gateSummary(model({ nodes: [] })).state).toBe("unserved");
  });
  it("pool bars compare capacity with window x factor", () => {
    const base = { name: "m", task: "text-generation", context_window: 512, queue_depth: 0, running: 0 };
    const pool = { page_size: 16, pages_total: 64, pages_free: 48, pages_reserved: 0, capacity_tokens: 1024, isolation_violations: 0 };
    expect(poolBar({ ...base, required_pool_tokens: 1024, fits: true, pool })).toMatchObject({ fits: true, percent: 100 });
    const small = poolBar({ ...base, required_pool_tokens: 4096, fits: false, pool });
    expect(small).toMatchObject({ fits: false, percent: 25 });
    expect(small?.label).toContain("1,024 tokens < 4,096 needed");
    expect(poolBar({ ...base, required_pool_tokens: null, fits: true })).toBeNull();
    expect(pageUse(pool)).toEqual({ used: 16, free: 48, total: 64, percent: 25 });
  });
});

describe("visibility changes", () => {
  it("private needs a reason", () => {
    expect(visibilityChange("private", "  ", [])).toHaveProperty("error");
    expect(visibilityChange("private", " leak ", ["t1", "t1", "t2"])).toEqual({
      body: { visibility: "private", reason: "leak", allow: ["t1", "t2"] },
    });
  });
  it("public clears the allow-list, reason optional", () => {
    expect(visibilityChange("public", "", ["t1"])).toEqual({ body: { visibility: "public", allow: [] } });
    expect(visibilityChange("public", "fixed", [])).toEqual({
      body: { visibility: "public", reason: "fixed", allow: [] },
    });
  });
});

describe("model form", () => {
  const f = {
    name: "@cf/x/big",
    task: "text-generation",
    context_window: "1048576",
    max_output_tokens: "",
    description: " d ",
    path: "",
    node: "",
  };
  it("builds the body", () => {
    expect(parseModelForm(f)).toEqual({
      body: { name: "@cf/x/big", task: "text-generation", context_window: 1048576, max_output_tokens: 0, description: "d" },
    });
  });
  it("rejects bad names and numbers", () => {
    expect(parseModelForm({ ...f, name: "big" })).toHaveProperty("error");
    expect(parseModelForm({ ...f, context_window: "0" })).toHaveProperty("error");
    expect(parseModelForm({ ...f, context_window: "1.5" })).toHaveProperty("error");
    expect(parseModelForm({ ...f, max_output_tokens: "-1" })).toHaveProperty("error");
  });
  it("loads a GGUF file on a node, the window then optional", () => {
    expect(parseModelForm({ ...f, context_window: "", path: " /m/a.gguf " })).toEqual({
      body: {
        name: "@cf/x/big",
        task: "text-generation",
        max_output_tokens: 0,
        description: "d",
        source: { node: "embedded", path: "/m/a.gguf" },
      },
    });
    expect(parseModelForm({ ...f, path: "/m/a.gguf", node: "gpu-1" })).toMatchObject({
      body: { context_window: 1048576, source: { node: "gpu-1", path: "/m/a.gguf" } },
    });
    expect(parseModelForm({ ...f, path: "m/a.gguf" })).toHaveProperty("error");
    expect(parseModelForm({ ...f, path: "/m/a.gguf", task: "text-embeddings" })).toHaveProperty("error");
    expect(parseModelForm({ ...f, context_window: "" })).toHaveProperty("error");
  });
});

describe("usage", () => {
  const rows: UsageRow[] = [
    { tenant_id: "t1", model: "m1", day: "2026-02-28", requests: 2, input_tokens: 10, output_tokens: 5, errors: {} },
    { tenant_id: "t2", model: "m1", day: "2026-03-01", requests: 3, input_tokens: 7, output_tokens: 1, errors: { bad_input: 1 } },
    { tenant_id: "t1", model: "m2", day: "2026-03-01", requests: 1, input_tokens: 4, output_tokens: 0, errors: { bad_input: 2, rate_limited: 3 } },
    { tenant_id: "t1", model: "m1", day: "2026-01-01", requests: 9, input_tokens: 9, output_tokens: 9, errors: {} },
  ];
  it("day ranges cross month ends in UTC", () => {
    expect(dayRange("2026-03-01", 3)).toEqual(["2026-02-27", "2026-02-28", "2026-03-01"]);
    expect(dayRange("2024-03-01", 2)).toEqual(["2024-02-29", "2024-03-01"]);
  });
  it("zero-fills series per model and drops days outside the range", () => {
    const s = usageSeries(rows, dayRange("2026-03-01", 3), "model");
    expect(s.labels).toEqual(["2026-02-27", "2026-02-28", "2026-03-01"]);
    expect(s.series.map((x) => x.key)).toEqual(["m1", "m2"]);
    expect(s.series[0]!.requests).toEqual([0, 2, 3]);
    expect(s.series[0]!.inputTokens).toEqual([0, 10, 7]);
    expect(s.series[1]!.requests).toEqual([0, 0, 1]);
  });
  it("groups by tenant", () => {
    const s = usageSeries(rows, dayRange("2026-03-01", 2), "tenant");
    expect(s.series.map((x) => [x.key, x.requests])).toEqual([
      ["t1", [2, 1]],
      ["t2", [0, 3]],
    ]);
  });
  it("totals, errors by code and per-pair sums", () => {
    expect(usageTotals(rows)).toEqual({ requests: 15, inputTokens: 30, outputTokens: 15, errors: 6 });
    expect(errorsByCode(rows)).toEqual([
      { code: "bad_input", count: 3 },
      { code: "rate_limited", count: 3 },
    ]);
    const pairs = usageByPair(rows);
    expect(pairs[0]).toMatchObject({ tenant_id: "t1", model: "m1", requests: 11 });
    expect(pairs).toHaveLength(3);
  });
});

describe("audit descriptions", () => {
  const tenants = [{ id: "t1", name: "acme", created_at: 0 }];
  const entry = (over: Partial<AuditEntry>): AuditEntry => ({
    id: 1,
    at: 1,
    actor: "admin:x",
    action: "model.visibility",
    target: "@cf/a/b",
    before: null,
    after: null,
    ...over,
  });
  it("visibility flips with reason and allow-list names", () => {
    expect(
      describeAudit(
        entry({
          before: { visibility: "public" },
          after: { visibility: "private", visibility_reason: "leak", allow: ["t1", "t9"] },
        }),
        tenants,
      ),
    ).toBe("public → private; reason: “leak”; allow-list: acme, t9");
  });
  it("prefix cache switches", () => {
    const flip = (on: boolean) =>
      describeAudit(entry({ action: "model.prefix_cache", before: { prefix_cache: !on }, after: { prefix_cache: on } }));
    expect(flip(false)).toBe("prefix cache off");
    expect(flip(true)).toBe("prefix cache on");
  });
  it("tokens, tenants and models", () => {
    expect(
      describeAudit(entry({ action: "token.create", after: { prefix: "bh_abc", tenant: "t1", name: "ci" } }), tenants),
    ).toBe("token bh_abc… created (“ci”) for acme");
    expect(describeAudit(entry({ action: "token.revoke", after: { tenant: "t1" } }), tenants)).toBe(
      "token revoked (tenant acme)",
    );
    expect(describeAudit(entry({ action: "tenant.create", after: { name: "acme" } }))).toBe("tenant “acme” created");
    expect(
      describeAudit(entry({ action: "model.create", after: { task: "text-generation", context_window: 1048576 } })),
    ).toBe("created (text-generation, context window 1,048,576, private)");
    expect(describeAudit(entry({ action: "something.else" }))).toBe("something.else");
  });
});
