// Shapes of the admin API's results (platform/src/routes/admin.rs).

export type Visibility = "public" | "private";

/** One serving node's verdict in the publish gate. */
export interface GateNode {
  node: string;
  pool_tokens?: number | null;
  required_tokens?: number | null;
  fits: boolean;
  reason: string | null;
}

export interface Model {
  name: string;
  task: string;
  description: string;
  context_window: number;
  max_output_tokens: number;
  visibility: Visibility;
  visibility_reason: string | null;
  /** Whether tenants' prompt pages are cached and reused (each tenant its own). */
  prefix_cache: boolean;
  allow: string[];
  properties: Record<string, unknown>;
  created_at: number;
  updated_at: number;
  nodes: GateNode[];
  publishable: boolean;
  publish_blocked_reason: string | null;
}

export interface PoolStats {
  page_size: number;
  pages_total: number;
  pages_free: number;
  pages_reserved: number;
  capacity_tokens: number;
  isolation_violations: number;
}

export interface NodeModel {
  name: string;
  task: string;
  context_window: number;
  required_pool_tokens: number | null;
  fits: boolean;
  pool?: PoolStats | null;
  queue_depth: number;
  running: number;
}

export interface NodeInfo {
  id: string;
  role: string;
  address: string;
  healthy: boolean;
  last_heartbeat: number;
  safety_factor: number;
  gpus: unknown[];
  models: NodeModel[];
}

export interface Tenant {
  id: string;
  name: string;
  created_at: number;
}

export interface TokenInfo {
  id: string;
  tenant_id: string;
  name: string | null;
  prefix: string;
  scope: string;
  created_at: number;
  revoked_at: number | null;
}

export interface CreatedToken {
  id: string;
  token: string;
  prefix: string;
}

export interface UsageRow {
  tenant_id: string;
  model: string;
  /** YYYY-MM-DD, UTC */
  day: string;
  requests: number;
  input_tokens: number;
  output_tokens: number;
  errors: Record<string, number>;
}

export interface AuditEntry {
  id: number;
  at: number;
  actor: string;
  action: string;
  target: string;
  before: Record<string, unknown> | null;
  after: Record<string, unknown> | null;
}
