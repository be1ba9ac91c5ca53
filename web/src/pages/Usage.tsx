import { useId, useMemo, useState } from "preact/hooks";

import { api, query } from "../api";
import { BarChart } from "../chart";
import { ErrorBanner, LiveControl, PageHeader } from "../components";
import { useLoad, useNow } from "../hooks";
import {
  dayRange,
  errorsByCode,
  formatInt,
  tenantLabel,
  usageByPair,
  usageSeries,
  usageTotals,
  utcToday,
  type GroupBy,
} from "../logic";
import type { Model, Tenant, UsageRow } from "../types";

const EVERY_S = 5;

export function UsagePage(props: { initialTenant: string | null; initialModel: string | null }) {
  const [tenant, setTenant] = useState(props.initialTenant ?? "");
  const [model, setModel] = useState(props.initialModel ?? "");
  const [days, setDays] = useState(14);
  const [groupBy, setGroupBy] = useState<GroupBy>("model");
  const [live, setLive] = useState(true);
  const usage = useLoad(() => api<UsageRow[]>("GET", `/usage${query({ tenant, model, days })}`), [tenant, model, days], {
    intervalMs: EVERY_S * 1000,
    live,
  });
  const tenants = useLoad(() => api<Tenant[]>("GET", "/tenants"), []);
  const models = useLoad(() => api<Model[]>("GET", "/models"), []);
  const now = useNow();
  const id = useId();
  const tenantList = tenants.data ?? [];
  const rows = usage.data ?? [];
  const today = utcToday(now);

  const series = useMemo(() => usageSeries(rows, dayRange(today, days), groupBy), [rows, today, days, groupBy]);
  const label = (key: string) => (groupBy === "tenant" ? tenantLabel(key, tenantList) : key);
  const requests = useMemo(
    () => series.series.map((s) => ({ label: label(s.key), data: s.requests })),
    // eslint-disable-next-line react-hooks/exhaustive-deps
    [series, tenantList],
  );
  const tokens = useMemo(() => {
    const sum = (pick: (s: (typeof series.series)[number]) => number[]) =>
      series.labels.map((_, i) => series.series.reduce((a, s) => a + (pick(s)[i] ?? 0), 0));
    return [
      { label: "Input tokens", data: sum((s) => s.inputTokens) },
      { label: "Output tokens", data: sum((s) => s.outputTokens) },
    ];
  }, [series]);
  const totals = usageTotals(rows);
  const errors = errorsByCode(rows);
  const pairs = usageByPair(rows);

  return (
    <section aria-labelledby="page-title">
      <PageHeader title="Usage">
        <LiveControl live={live} setLive={setLive} updatedAt={usage.updatedAt} now={now} everySeconds={EVERY_S} />
      </PageHeader>
      <form class="filters" onSubmit={(e) => e.preventDefault()}>
        <div class="field">
          <label for={`${id}-tenant`}>Tenant</label>
          <select id={`${id}-tenant`} value={tenant} onChange={(e) => setTenant((e.currentTarget as HTMLSelectElement).value)}>
            <option value="">All tenants</option>
            {tenantList.map((t) => (
              <option key={t.id} value={t.id}>
                {t.name}
              </option>
            ))}
          </select>
        </div>
        <div class="field">
          <label for={`${id}-model`}>Model</label>
          <select id={`${id}-model`} value={model} onChange={(e) => setModel((e.currentTarget as HTMLSelectElement).value)}>
            <option value="">All models</option>
            {(models.data ?? []).map((m) => (
              <option key={m.name} value={m.name}>
                {m.name}
              </option>
            ))}
          </select>
        </div>
        <div class="field">
          <label for={`${id}-days`}>Period</label>
          <select id={`${id}-days`} value={String(days)} onChange={(e) => setDays(Number((e.currentTarget as HTMLSelectElement).value))}>
            <option value="7">last 7 days</option>
            <option value="14">last 14 days</option>
            <option value="30">last 30 days</option>
            <option value="90">last 90 days</option>
          </select>
        </div>
        <div class="field">
          <label for={`${id}-group`}>Requests by</label>
          <select id={`${id}-group`} value={groupBy} onChange={(e) => setGroupBy((e.currentTarget as HTMLSelectElement).value as GroupBy)}>
            <option value="model">model</option>
            <option value="tenant">tenant</option>
          </select>
        </div>
      </form>
      <ErrorBanner message={usage.error} onRetry={() => void usage.reload()} />
      <dl class="totals" aria-label="Totals for the period">
        <div>
          <dt>Requests</dt>
          <dd data-total="requests">{formatInt(totals.requests)}</dd>
        </div>
        <div>
          <dt>Input tokens</dt>
          <dd>{formatInt(totals.inputTokens)}</dd>
        </div>
        <div>
          <dt>Output tokens</dt>
          <dd>{formatInt(totals.outputTokens)}</dd>
        </div>
        <div>
          <dt>Errors</dt>
          <dd>{formatInt(totals.errors)}</dd>
        </div>
      </dl>
      <div class="charts">
        <BarChart title={`Requests per day (UTC), by ${groupBy}`} labels={series.labels} datasets={requests} stacked />
        <BarChart title="Tokens per day (UTC)" labels={series.labels} datasets={tokens} stacked />
      </div>
      <div class="two-col">
        <section class="card" aria-labelledby={`${id}-errors`}>
          <h2 id={`${id}-errors`}>Errors by code</h2>
          {errors.length === 0 ? (
            <p class="muted">No errors in this period.</p>
          ) : (
            <table>
              <thead>
                <tr>
                  <th scope="col">Code</th>
                  <th scope="col" class="num">
                    Count
                  </th>
                </tr>
              </thead>
              <tbody>
                {errors.map((e) => (
                  <tr key={e.code}>
                    <th scope="row">
                      <code>{e.code}</code>
                    </th>
                    <td class="num">{formatInt(e.count)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
        </section>
        <section class="card" aria-labelledby={`${id}-pairs`}>
          <h2 id={`${id}-pairs`}>Per tenant and model</h2>
          {pairs.length === 0 ? (
            <p class="muted">No requests in this period.</p>
          ) : (
            <div class="table-wrap">
              <table>
                <thead>
                  <tr>
                    <th scope="col">Tenant</th>
                    <th scope="col">Model</th>
                    <th scope="col" class="num">
                      Requests
                    </th>
                    <th scope="col" class="num">
                      Input
                    </th>
                    <th scope="col" class="num">
                      Output
                    </th>
                    <th scope="col" class="num">
                      Errors
                    </th>
                  </tr>
                </thead>
                <tbody>
                  {pairs.map((p) => (
                    <tr key={`${p.tenant_id}/${p.model}`}>
                      <td>{tenantLabel(p.tenant_id, tenantList)}</td>
                      <td>
                        <code>{p.model}</code>
                      </td>
                      <td class="num">{formatInt(p.requests)}</td>
                      <td class="num">{formatInt(p.inputTokens)}</td>
                      <td class="num">{formatInt(p.outputTokens)}</td>
                      <td class="num">{formatInt(p.errors)}</td>
                    </tr>
                  ))}
                </tbody>
              </table>
            </div>
          )}
        </section>
      </div>
    </section>
  );
}
