import { useId } from "preact/hooks";

import { api, query } from "../api";
import { ErrorBanner, PageHeader } from "../components";
import { useLoad, useNow } from "../hooks";
import { describeAudit, formatTime, relativeTime, tenantLabel } from "../logic";
import type { AuditEntry, Model, Tenant } from "../types";

export function AuditPage(props: {
  model: string;
  tenant: string;
  onFilter: (f: { model: string; tenant: string }) => void;
}) {
  const { model, tenant } = props;
  const audit = useLoad(() => api<AuditEntry[]>("GET", `/audit${query({ model, tenant, limit: 200 })}`), [model, tenant]);
  const tenants = useLoad(() => api<Tenant[]>("GET", "/tenants"), []);
  const models = useLoad(() => api<Model[]>("GET", "/models"), []);
  const now = useNow(5000);
  const id = useId();
  const tenantList = tenants.data ?? [];
  const modelNames = (models.data ?? []).map((m) => m.name);
  if (model && !modelNames.includes(model)) modelNames.push(model);

  return (
    <section aria-labelledby="page-title">
      <PageHeader title="Audit log">
        <button type="button" class="button-small" onClick={() => void audit.reload()}>
          Refresh
        </button>
      </PageHeader>
      <p class="lead">Every admin action, newest first.</p>
      <form class="filters" onSubmit={(e) => e.preventDefault()}>
        <div class="field">
          <label for={`${id}-model`}>Model</label>
          <select
            id={`${id}-model`}
            value={model}
            onChange={(e) => props.onFilter({ model: (e.currentTarget as HTMLSelectElement).value, tenant })}
          >
            <option value="">All models</option>
            {modelNames.map((m) => (
              <option key={m} value={m}>
                {m}
              </option>
            ))}
          </select>
        </div>
        <div class="field">
          <label for={`${id}-tenant`}>Tenant</label>
          <select
            id={`${id}-tenant`}
            value={tenant}
            onChange={(e) => props.onFilter({ model, tenant: (e.currentTarget as HTMLSelectElement).value })}
          >
            <option value="">All tenants</option>
            {tenantList.map((t) => (
              <option key={t.id} value={t.id}>
                {t.name}
              </option>
            ))}
            {tenant && !tenantList.some((t) => t.id === tenant) && <option value={tenant}>{tenant}</option>}
          </select>
        </div>
      </form>
      <ErrorBanner message={audit.error} onRetry={() => void audit.reload()} />
      {audit.loading && !audit.data && <p aria-busy="true">Loading the audit log…</p>}
      {audit.data && (
        <div class="table-wrap">
          <table class="audit">
            <caption class="visually-hidden">Audit log entries, newest first</caption>
            <thead>
              <tr>
                <th scope="col">When</th>
                <th scope="col">Who</th>
                <th scope="col">Action</th>
                <th scope="col">Target</th>
                <th scope="col">Change</th>
              </tr>
            </thead>
            <tbody>
              {audit.data.map((e) => (
                <tr key={e.id} data-action={e.action}>
                  <td class="small">
                    {formatTime(e.at)}
                    <div class="muted">{relativeTime(e.at, now)}</div>
                  </td>
                  <td class="small">
                    <code>{e.actor}</code>
                  </td>
                  <td>
                    <code>{e.action}</code>
                  </td>
                  <td class="small">
                    <code>{e.action === "tenant.create" ? tenantLabel(e.target, tenantList) : e.target}</code>
                  </td>
                  <td>
                    {describeAudit(e, tenantList)}
                    {(e.before || e.after) && (
                      <details class="small">
                        <summary>Before and after</summary>
                        <pre>{JSON.stringify({ before: e.before, after: e.after }, null, 2)}</pre>
                      </details>
                    )}
                  </td>
                </tr>
              ))}
              {audit.data.length === 0 && (
                <tr>
                  <td colSpan={5}>No entries match.</td>
                </tr>
              )}
            </tbody>
          </table>
        </div>
      )}
    </section>
  );
}
