import { useId, useState } from "preact/hooks";

import { api, modelPath } from "../api";
import { Dialog, ErrorBanner, Notice, PageHeader, Switch } from "../components";
import { useLoad } from "../hooks";
import {
  formatInt,
  gateSummary,
  parseModelForm,
  routeHref,
  tenantLabel,
  toggleBlock,
  visibilityChange,
  type ModelForm,
} from "../logic";
import type { Model, Tenant, Visibility } from "../types";

interface Pending {
  model: Model;
  target: Visibility;
  /** Only the allow-list changes (the model stays private). */
  allowOnly: boolean;
}

export function CatalogPage() {
  const models = useLoad(() => api<Model[]>("GET", "/models"), []);
  const tenants = useLoad(() => api<Tenant[]>("GET", "/tenants"), []);
  const [pending, setPending] = useState<Pending | null>(null);
  const [removing, setRemoving] = useState<Model | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const list = models.data ?? [];
  const tenantList = tenants.data ?? [];

  return (
    <section aria-labelledby="page-title">
      <PageHeader title="Model catalog">
        <button type="button" class="button-small" onClick={() => void models.reload()}>
          Refresh
        </button>
      </PageHeader>
      <p class="lead">
        A private model answers HTTP 400 to every tenant not on its allow-list, within a second.
        A model goes public only when every node serving it has a KV pool of at least its
        context window × the safety factor.
      </p>
      <ErrorBanner message={models.error} onRetry={() => void models.reload()} />
      <ErrorBanner message={tenants.error} />
      <Notice message={notice} />
      {models.loading && !models.data && <p aria-busy="true">Loading the catalog…</p>}
      {models.data && (
        <div class="table-wrap">
          <table class="catalog">
            <caption class="visually-hidden">Models, their limits, visibility and publish gate</caption>
            <thead>
              <tr>
                <th scope="col">Model</th>
                <th scope="col">Task</th>
                <th scope="col" class="num">
                  Context window
                </th>
                <th scope="col" class="num">
                  Max output tokens
                </th>
                <th scope="col">Visibility</th>
                <th scope="col">Prefix cache</th>
                <th scope="col">Pre-deployment gate</th>
              </tr>
            </thead>
            <tbody>
              {list.map((m) => (
                <ModelRow
                  key={m.name}
                  model={m}
                  tenants={tenantList}
                  onToggle={() =>
                    setPending({ model: m, target: m.visibility === "public" ? "private" : "public", allowOnly: false })
                  }
                  onEditAllow={() => setPending({ model: m, target: "private", allowOnly: true })}
                  onRemove={() => setRemoving(m)}
                  onCacheToggled={(changed, error) => {
                    setNotice(error ?? `Prefix cache of ${changed.name} is now ${changed.prefix_cache ? "on" : "off"}.`);
                    void models.reload();
                  }}
                />
              ))}
              {list.length === 0 && (
                <tr>
                  <td colSpan={7}>No models in the catalog.</td>
                </tr>
              )}
            </tbody>
          </table>
        </div>
      )}
      <NewModel
        onCreated={(m) => {
          setNotice(
            m.nodes.length
              ? `Created ${m.name}, served by ${m.nodes.map((n) => n.node).join(", ")}; it starts private.`
              : `Created ${m.name}; it starts private.`,
          );
          void models.reload();
        }}
      />
      {removing && (
        <RemoveDialog
          model={removing}
          onClose={() => setRemoving(null)}
          onDone={(removedFrom) => {
            setNotice(
              removedFrom.length
                ? `Removed ${removing.name} from ${removedFrom.join(", ")} and from the catalog.`
                : `Removed ${removing.name} from the catalog.`,
            );
            setRemoving(null);
            void models.reload();
          }}
        />
      )}
      {pending && (
        <VisibilityDialog
          pending={pending}
          tenants={tenantList}
          onClose={() => setPending(null)}
          onDone={(m) => {
            setPending(null);
            setNotice(
              pending.allowOnly
                ? `Allow-list of ${m.name} saved.`
                : `${m.name} is now ${m.visibility}.`,
            );
            void models.reload();
          }}
        />
      )}
    </section>
  );
}

function ModelRow(props: {
  model: Model;
  tenants: Tenant[];
  onToggle: () => void;
  onEditAllow: () => void;
  onRemove: () => void;
  onCacheToggled: (m: Model, error: string | null) => void;
}) {
  const m = props.model;
  const [saving, setSaving] = useState(false);
  // Turning the cache off takes nothing away from a tenant's answers (only their speed), so
  // it switches at once, without a dialog.
  const toggleCache = async () => {
    setSaving(true);
    try {
      const changed = await api<Model>("PATCH", `/models/${modelPath(m.name)}`, { prefix_cache: !m.prefix_cache });
      props.onCacheToggled(changed, null);
    } catch (e) {
      props.onCacheToggled(m, `Could not switch the prefix cache of ${m.name}: ${e instanceof Error ? e.message : String(e)}`);
    } finally {
      setSaving(false);
    }
  };
  const gate = gateSummary(m);
  const block = toggleBlock(m);
  const gateId = useId();
  const blockId = useId();
  return (
    <tr data-model={m.name}>
      <th scope="row">
        <code>{m.name}</code>
        {m.description && <div class="muted small">{m.description}</div>}
        <button type="button" class="link-button small" onClick={props.onRemove} aria-label={`Remove ${m.name}`}>
          remove
        </button>
      </th>
      <td>{m.task}</td>
      <td class="num">{formatInt(m.context_window)}</td>
      <td class="num">{formatInt(m.max_output_tokens)}</td>
      <td>
        <Switch
          checked={m.visibility === "public"}
          label={`Public: ${m.name}`}
          onText="Public"
          offText="Private"
          disabled={block !== null}
          describedBy={block ? blockId : gateId}
          onToggle={props.onToggle}
        />
        {block && (
          <p id={blockId} class="blocked small">
            {block}
          </p>
        )}
        {m.visibility === "private" && (
          <div class="small">
            {m.visibility_reason && (
              <div>
                Reason: <q>{m.visibility_reason}</q>
              </div>
            )}
            <div>
              Allow-list:{" "}
              {m.allow.length ? m.allow.map((id) => tenantLabel(id, props.tenants)).join(", ") : "nobody"}{" "}
              <button type="button" class="link-button" onClick={props.onEditAllow} aria-label={`Edit the allow-list of ${m.name}`}>
                edit
              </button>
            </div>
          </div>
        )}
        <div class="small">
          <a href={routeHref("audit", { model: m.name })}>Audit log</a>
        </div>
      </td>
      <td>
        {m.task === "text-generation" ? (
          <Switch
            checked={m.prefix_cache}
            label={`Prefix cache: ${m.name}`}
            disabled={saving}
            onToggle={() => void toggleCache()}
          />
        ) : (
          <span class="muted small">no KV cache</span>
        )}
      </td>
      <td>
        <div id={gateId} class={`gate gate-${gate.state}`}>
          <span class="gate-mark" aria-hidden="true">
            {gate.state === "fits" ? "✓" : gate.state === "blocked" ? "✕" : "–"}
          </span>{" "}
          {gate.state === "blocked" ? <strong>Unsafe to publish: </strong> : null}
          {gate.text}
        </div>
        {gate.details.length > 0 && (
          <ul class="gate-details small">
            {gate.details.map((d) => (
              <li key={d}>{d}</li>
            ))}
          </ul>
        )}
      </td>
    </tr>
  );
}

function VisibilityDialog(props: {
  pending: Pending;
  tenants: Tenant[];
  onClose: () => void;
  onDone: (m: Model) => void;
}) {
  const { model, target, allowOnly } = props.pending;
  const [reason, setReason] = useState(allowOnly ? model.visibility_reason ?? "" : "");
  const [allow, setAllow] = useState<string[]>(model.allow);
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const reasonId = useId();
  const hintId = useId();
  const title = allowOnly
    ? `Allow-list of ${model.name}`
    : target === "private"
      ? `Make ${model.name} private`
      : `Make ${model.name} public`;
  const confirmText = allowOnly ? "Save allow-list" : target === "private" ? "Make private" : "Make public";

  async function submit(e: Event) {
    e.preventDefault();
    const change = visibilityChange(target, reason, allow);
    if ("error" in change) {
      setError(change.error);
      return;
    }
    setBusy(true);
    setError(null);
    try {
      const m = await api<Model>("PATCH", `/models/${modelPath(model.name)}`, change.body);
      props.onDone(m);
    } catch (err) {
      setError(err instanceof Error ? err.message : String(err));
      setBusy(false);
    }
  }

  return (
    <Dialog title={title} onClose={props.onClose}>
      <form onSubmit={submit} noValidate>
        <p id={hintId}>
          {target === "private"
            ? "Every tenant not on the allow-list gets HTTP 400 (no such model) for it, on every replica, within a second."
            : "Every tenant will be able to call it. The publish gate checks each serving node's pool first."}
        </p>
        <div class="field">
          <label for={reasonId}>
            Reason{target === "private" ? "" : " (optional)"}
          </label>
          <textarea
            id={reasonId}
            rows={3}
            required={target === "private"}
            aria-describedby={hintId}
            value={reason}
            onInput={(e) => setReason((e.currentTarget as HTMLTextAreaElement).value)}
            autofocus
          />
        </div>
        {target === "private" && (
          <fieldset class="field">
            <legend>Tenants that keep access (allow-list)</legend>
            {props.tenants.length === 0 && <p class="muted small">No tenants yet.</p>}
            {props.tenants.map((t) => (
              <label key={t.id} class="check">
                <input
                  type="checkbox"
                  checked={allow.includes(t.id)}
                  onChange={(e) => {
                    const on = (e.currentTarget as HTMLInputElement).checked;
                    setAllow((a) => (on ? [...a, t.id] : a.filter((x) => x !== t.id)));
                  }}
                />{" "}
                {t.name} <span class="muted small">({t.id})</span>
              </label>
            ))}
          </fieldset>
        )}
        <ErrorBanner message={error} />
        <div class="actions">
          <button type="button" onClick={props.onClose}>
            Cancel
          </button>
          <button type="submit" class={target === "private" && !allowOnly ? "danger" : "primary"} disabled={busy}>
            {confirmText}
          </button>
        </div>
      </form>
    </Dialog>
  );
}

/** Confirms and removes a model: off every node that serves it (each finishes what it
 * admitted), then out of the catalog. */
function RemoveDialog(props: { model: Model; onClose: () => void; onDone: (removedFrom: string[]) => void }) {
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  async function submit(e: Event) {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      const r = await api<{ removed_from: string[] }>("DELETE", `/models/${modelPath(props.model.name)}`);
      props.onDone(r.removed_from);
    } catch (err) {
      setError(err instanceof Error ? err.message : String(err));
      setBusy(false);
    }
  }
  return (
    <Dialog title={`Remove ${props.model.name}`} onClose={props.onClose}>
      <form onSubmit={submit} noValidate>
        <p>
          Every node that serves it stops taking requests for it, finishes what it admitted and frees its memory;
          then it leaves the catalog, and tenants get HTTP 400 (no such model). Its usage history stays.
        </p>
        <ErrorBanner message={error} />
        <div class="actions">
          <button type="button" onClick={props.onClose}>
            Cancel
          </button>
          <button type="submit" class="danger" disabled={busy}>
            Remove
          </button>
        </div>
      </form>
    </Dialog>
  );
}

function NewModel(props: { onCreated: (m: Model) => void }) {
  const empty: ModelForm = {
    name: "",
    task: "text-generation",
    context_window: "",
    max_output_tokens: "",
    description: "",
    path: "",
    node: "embedded",
  };
  const [form, setForm] = useState<ModelForm>(empty);
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const id = useId();
  const set = (k: keyof ModelForm) => (e: Event) =>
    setForm({ ...form, [k]: (e.currentTarget as HTMLInputElement | HTMLSelectElement).value });

  async function submit(e: Event) {
    e.preventDefault();
    const parsed = parseModelForm(form);
    if ("error" in parsed) {
      setError(parsed.error);
      return;
    }
    setBusy(true);
    setError(null);
    try {
      const m = await api<Model>("POST", "/models", parsed.body);
      setForm(empty);
      props.onCreated(m);
    } catch (err) {
      setError(err instanceof Error ? err.message : String(err));
    } finally {
      setBusy(false);
    }
  }

  return (
    <section class="card" aria-labelledby={`${id}-h`}>
      <h2 id={`${id}-h`}>Add a model</h2>
      <p class="muted small">
        New models start private. Give a GGUF file on a node's machine and that node loads it now (and again after a
        restart); otherwise nodes that serve the model register it by heartbeat.
      </p>
      <form onSubmit={submit} class="form-grid" noValidate>
        <div class="field">
          <label for={`${id}-name`}>Name</label>
          <input id={`${id}-name`} value={form.name} onInput={set("name")} placeholder="@cf/author/model" required />
        </div>
        <div class="field">
          <label for={`${id}-task`}>Task</label>
          <select id={`${id}-task`} value={form.task} onChange={set("task")}>
            <option value="text-generation">text-generation</option>
            <option value="text-embeddings">text-embeddings</option>
          </select>
        </div>
        <div class="field">
          <label for={`${id}-window`}>Context window (tokens)</label>
          <input
            id={`${id}-window`}
            inputMode="numeric"
            value={form.context_window}
            onInput={set("context_window")}
            required={form.path.trim() === ""}
          />
        </div>
        <div class="field">
          <label for={`${id}-max`}>Max output tokens</label>
          <input id={`${id}-max`} inputMode="numeric" value={form.max_output_tokens} onInput={set("max_output_tokens")} />
        </div>
        <div class="field field-wide">
          <label for={`${id}-desc`}>Description</label>
          <input id={`${id}-desc`} value={form.description} onInput={set("description")} />
        </div>
        <div class="field field-wide">
          <label for={`${id}-path`}>GGUF file on the node (optional)</label>
          <input id={`${id}-path`} value={form.path} onInput={set("path")} placeholder="/models/model.gguf" />
        </div>
        <div class="field">
          <label for={`${id}-node`}>Node that loads it</label>
          <input id={`${id}-node`} value={form.node} onInput={set("node")} />
        </div>
        <div class="actions field-wide">
          <button type="submit" class="primary" disabled={busy}>
            Add model
          </button>
        </div>
      </form>
      <ErrorBanner message={error} />
    </section>
  );
}
