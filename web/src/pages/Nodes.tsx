import { useState } from "preact/hooks";

import { api } from "../api";
import { ErrorBanner, LiveControl, PageHeader } from "../components";
import { useLoad, useNow } from "../hooks";
import { formatInt, formatTime, pageUse, poolBar, relativeTime } from "../logic";
import type { NodeInfo, NodeModel } from "../types";

const EVERY_S = 2;

export function NodesPage() {
  const [live, setLive] = useState(true);
  const nodes = useLoad(() => api<NodeInfo[]>("GET", "/nodes"), [], { intervalMs: EVERY_S * 1000, live });
  const now = useNow();
  return (
    <section aria-labelledby="page-title">
      <PageHeader title="Nodes">
        <LiveControl live={live} setLive={setLive} updatedAt={nodes.updatedAt} now={now} everySeconds={EVERY_S} />
      </PageHeader>
      <p class="lead">
        Each node's KV pool per text model against the catalog's context window × the safety factor:
        a green bar fits, a red bar does not (requests are not routed there, and the model cannot be
        made public while it serves it).
      </p>
      <ErrorBanner message={nodes.error} onRetry={() => void nodes.reload()} />
      {nodes.loading && !nodes.data && <p aria-busy="true">Loading nodes…</p>}
      <div class="node-list">
        {(nodes.data ?? []).map((n) => (
          <NodeCard key={n.id} node={n} now={now} />
        ))}
      </div>
    </section>
  );
}

function NodeCard(props: { node: NodeInfo; now: number }) {
  const n = props.node;
  return (
    <article class="card node" aria-labelledby={`node-${n.id}`} data-node={n.id}>
      <header class="node-head">
        <h2 id={`node-${n.id}`}>{n.id}</h2>
        <span class={`badge ${n.healthy ? "badge-ok" : "badge-bad"}`}>{n.healthy ? "healthy" : "unhealthy"}</span>
      </header>
      <dl class="facts">
        <div>
          <dt>Role</dt>
          <dd>{n.role}</dd>
        </div>
        <div>
          <dt>Address</dt>
          <dd>
            <code>{n.address}</code>
          </dd>
        </div>
        <div>
          <dt>Last heartbeat</dt>
          <dd title={formatTime(n.last_heartbeat)}>{relativeTime(n.last_heartbeat, props.now)}</dd>
        </div>
        <div>
          <dt>Safety factor</dt>
          <dd>{n.safety_factor}</dd>
        </div>
        <div>
          <dt>GPUs</dt>
          <dd>{n.gpus.length || "none"}</dd>
        </div>
      </dl>
      <div class="table-wrap">
        <table>
          <caption class="visually-hidden">Models served by {n.id}</caption>
          <thead>
            <tr>
              <th scope="col">Model</th>
              <th scope="col">Pool capacity vs context window × factor</th>
              <th scope="col" class="num">
                KV pages used / free
              </th>
              <th scope="col" class="num">
                Queue
              </th>
              <th scope="col" class="num">
                Running
              </th>
            </tr>
          </thead>
          <tbody>
            {n.models.map((m) => (
              <ModelLine key={m.name} m={m} />
            ))}
          </tbody>
        </table>
      </div>
    </article>
  );
}

function ModelLine(props: { m: NodeModel }) {
  const m = props.m;
  const bar = poolBar(m);
  const pages = m.pool ? pageUse(m.pool) : null;
  return (
    <tr data-model={m.name}>
      <th scope="row">
        <code>{m.name}</code>
        <div class="muted small">
          {m.task}, window {formatInt(m.context_window)}
        </div>
      </th>
      <td>
        {bar ? (
          <div class={`fit ${bar.fits ? "fit-ok" : "fit-bad"}`}>
            <div
              class="bar"
              role="meter"
              aria-valuemin={0}
              aria-valuemax={100}
              aria-valuenow={bar.percent}
              aria-label={`${m.name}: ${bar.label}`}
            >
              <span style={{ width: `${bar.percent}%` }} />
            </div>
            <span class="small">
              <strong>{bar.fits ? "fits" : "too small"}</strong>: {bar.label}
            </span>
          </div>
        ) : (
          <span class="muted small">no KV pool (embeddings)</span>
        )}
      </td>
      <td class="num">
        {pages ? (
          <>
            {formatInt(pages.used)} / {formatInt(pages.free)}
            <div class="muted small">
              of {formatInt(pages.total)} ({pages.percent}% used)
            </div>
          </>
        ) : (
          "—"
        )}
      </td>
      <td class="num">{formatInt(m.queue_depth)}</td>
      <td class="num">{formatInt(m.running)}</td>
    </tr>
  );
}
