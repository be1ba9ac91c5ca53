import { useId, useRef, useState } from "preact/hooks";

import { api } from "../api";
import { Dialog, ErrorBanner, Notice, PageHeader } from "../components";
import { useLoad } from "../hooks";
import { formatTime, routeHref } from "../logic";
import type { CreatedToken, Tenant, TokenInfo } from "../types";

export function TenantsPage(props: { selected: string | null; onSelect: (id: string) => void }) {
  const tenants = useLoad(() => api<Tenant[]>("GET", "/tenants"), []);
  const [notice, setNotice] = useState<string | null>(null);
  const list = tenants.data ?? [];
  const selected = list.find((t) => t.id === props.selected) ?? null;

  return (
    <section aria-labelledby="page-title">
      <PageHeader title="Tenants and API tokens" />
      <ErrorBanner message={tenants.error} onRetry={() => void tenants.reload()} />
      <Notice message={notice} />
      <div class="two-col">
        <div>
          <NewTenant
            onCreated={(t) => {
              setNotice(`Tenant ${t.name} created (account id ${t.id}).`);
              void tenants.reload();
              props.onSelect(t.id);
            }}
          />
          {tenants.loading && !tenants.data && <p aria-busy="true">Loading tenants…</p>}
          {tenants.data && (
            <div class="table-wrap">
              <table>
                <caption class="visually-hidden">Tenants</caption>
                <thead>
                  <tr>
                    <th scope="col">Name</th>
                    <th scope="col">Account id</th>
                    <th scope="col">Created</th>
                    <th scope="col">
                      <span class="visually-hidden">Actions</span>
                    </th>
                  </tr>
                </thead>
                <tbody>
                  {list.map((t) => (
                    <tr key={t.id} aria-current={t.id === props.selected ? "true" : undefined} data-tenant={t.name}>
                      <th scope="row">{t.name}</th>
                      <td>
                        <code>{t.id}</code>
                      </td>
                      <td class="small">{formatTime(t.created_at)}</td>
                      <td>
                        <button
                          type="button"
                          class="button-small"
                          aria-pressed={t.id === props.selected}
                          aria-label={`Tokens of ${t.name}`}
                          onClick={() => props.onSelect(t.id)}
                        >
                          Tokens
                        </button>
                      </td>
                    </tr>
                  ))}
                  {list.length === 0 && (
                    <tr>
                      <td colSpan={4}>No tenants yet.</td>
                    </tr>
                  )}
                </tbody>
              </table>
            </div>
          )}
        </div>
        <div>{selected ? <Tokens key={selected.id} tenant={selected} /> : <p class="muted">Pick a tenant to see its tokens.</p>}</div>
      </div>
    </section>
  );
}

function NewTenant(props: { onCreated: (t: Tenant) => void }) {
  const [name, setName] = useState("");
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const id = useId();
  async function submit(e: Event) {
    e.preventDefault();
    if (!name.trim()) {
      setError("Give the tenant a name.");
      return;
    }
    setBusy(true);
    setError(null);
    try {
      const t = await api<Tenant>("POST", "/tenants", { name: name.trim() });
      setName("");
      props.onCreated(t);
    } catch (err) {
      setError(err instanceof Error ? err.message : String(err));
    } finally {
      setBusy(false);
    }
  }
  return (
    <form class="card inline-form" onSubmit={submit} noValidate aria-labelledby={`${id}-h`}>
      <h2 id={`${id}-h`}>New tenant</h2>
      <div class="field">
        <label for={`${id}-name`}>Tenant name</label>
        <input id={`${id}-name`} value={name} onInput={(e) => setName((e.currentTarget as HTMLInputElement).value)} />
      </div>
      <button type="submit" class="primary" disabled={busy}>
        Create tenant
      </button>
      <ErrorBanner message={error} />
    </form>
  );
}

function Tokens(props: { tenant: Tenant }) {
  const t = props.tenant;
  const tokens = useLoad(() => api<TokenInfo[]>("GET", `/tenants/${encodeURIComponent(t.id)}/tokens`), [t.id]);
  const [name, setName] = useState("");
  const [created, setCreated] = useState<CreatedToken | null>(null);
  const [revoking, setRevoking] = useState<TokenInfo | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const id = useId();

  async function create(e: Event) {
    e.preventDefault();
    setError(null);
    try {
      const body = name.trim() ? { name: name.trim() } : {};
      const c = await api<CreatedToken>("POST", `/tenants/${encodeURIComponent(t.id)}/tokens`, body);
      setCreated(c);
      setName("");
      setNotice(null);
      void tokens.reload();
    } catch (err) {
      setError(err instanceof Error ? err.message : String(err));
    }
  }

  return (
    <section class="card" aria-labelledby={`${id}-h`}>
      <h2 id={`${id}-h`}>Tokens of {t.name}</h2>
      <p class="small">
        Account id <code>{t.id}</code> · <a href={routeHref("audit", { tenant: t.id })}>audit log</a> ·{" "}
        <a href={routeHref("usage", { tenant: t.id })}>usage</a>
      </p>
      <form class="inline-form" onSubmit={create} noValidate>
        <div class="field">
          <label for={`${id}-name`}>Token name (optional)</label>
          <input id={`${id}-name`} value={name} onInput={(e) => setName((e.currentTarget as HTMLInputElement).value)} />
        </div>
        <button type="submit" class="primary">
          Create token
        </button>
      </form>
      <ErrorBanner message={error} />
      <Notice message={notice} />
      {created && <Secret created={created} onDismiss={() => setCreated(null)} />}
      <ErrorBanner message={tokens.error} onRetry={() => void tokens.reload()} />
      {tokens.data && (
        <div class="table-wrap">
          <table>
            <caption class="visually-hidden">Tokens of {t.name}</caption>
            <thead>
              <tr>
                <th scope="col">Name</th>
                <th scope="col">Prefix</th>
                <th scope="col">Created</th>
                <th scope="col">Status</th>
                <th scope="col">
                  <span class="visually-hidden">Actions</span>
                </th>
              </tr>
            </thead>
            <tbody>
              {tokens.data.map((k) => (
                <tr key={k.id} data-token={k.prefix}>
                  <td>{k.name ?? <span class="muted">unnamed</span>}</td>
                  <td>
                    <code>{k.prefix}…</code>
                  </td>
                  <td class="small">{formatTime(k.created_at)}</td>
                  <td>
                    {k.revoked_at ? (
                      <span class="badge badge-bad">revoked {formatTime(k.revoked_at)}</span>
                    ) : (
                      <span class="badge badge-ok">active</span>
                    )}
                  </td>
                  <td>
                    {!k.revoked_at && (
                      <button
                        type="button"
                        class="button-small danger"
                        aria-label={`Revoke token ${k.prefix}`}
                        onClick={() => setRevoking(k)}
                      >
                        Revoke
                      </button>
                    )}
                  </td>
                </tr>
              ))}
              {tokens.data.length === 0 && (
                <tr>
                  <td colSpan={5}>No tokens yet.</td>
                </tr>
              )}
            </tbody>
          </table>
        </div>
      )}
      {revoking && (
        <RevokeDialog
          token={revoking}
          onClose={() => setRevoking(null)}
          onDone={() => {
            setNotice(`Token ${revoking.prefix}… revoked; it now gets HTTP 401.`);
            setRevoking(null);
            if (created?.id === revoking.id) setCreated(null);
            void tokens.reload();
          }}
        />
      )}
    </section>
  );
}

/** The new token's secret, shown once, with a copy button. */
function Secret(props: { created: CreatedToken; onDismiss: () => void }) {
  const [copied, setCopied] = useState<string | null>(null);
  const input = useRef<HTMLInputElement>(null);
  const id = useId();
  async function copy() {
    const text = props.created.token;
    try {
      await navigator.clipboard.writeText(text);
      setCopied("Copied to the clipboard.");
    } catch {
      // No clipboard permission: select it so that Ctrl+C copies it.
      input.current?.select();
      setCopied("Selected: press Ctrl+C to copy.");
    }
  }
  return (
    <div class="secret" role="region" aria-labelledby={`${id}-h`}>
      <h3 id={`${id}-h`}>New token {props.created.prefix}…</h3>
      <p class="small">Copy it now: the secret is shown once and is not stored in clear.</p>
      <div class="inline-form">
        <label for={`${id}-v`} class="visually-hidden">
          Token secret
        </label>
        <input id={`${id}-v`} ref={input} class="mono" readOnly value={props.created.token} onFocus={(e) => (e.currentTarget as HTMLInputElement).select()} />
        <button type="button" onClick={() => void copy()}>
          Copy
        </button>
        <button type="button" onClick={props.onDismiss}>
          Done
        </button>
      </div>
      <p role="status" class="small">
        {copied}
      </p>
    </div>
  );
}

function RevokeDialog(props: { token: TokenInfo; onClose: () => void; onDone: () => void }) {
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  async function revoke() {
    setBusy(true);
    setError(null);
    try {
      await api("DELETE", `/tokens/${encodeURIComponent(props.token.id)}`);
      props.onDone();
    } catch (err) {
      setError(err instanceof Error ? err.message : String(err));
      setBusy(false);
    }
  }
  return (
    <Dialog title={`Revoke token ${props.token.prefix}…`} onClose={props.onClose}>
      <p>Requests with this token will get HTTP 401 from now on. This cannot be undone.</p>
      <ErrorBanner message={error} />
      <div class="actions">
        <button type="button" onClick={props.onClose} autofocus>
          Cancel
        </button>
        <button type="button" class="danger" disabled={busy} onClick={() => void revoke()}>
          Revoke token
        </button>
      </div>
    </Dialog>
  );
}
