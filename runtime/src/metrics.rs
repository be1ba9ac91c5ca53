//! Prometheus metrics of a node, encoded in the text exposition format at `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectLabel {
    pub model: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabel {
    /// `send` on a prefill node, `receive` on a decode node.
    pub side: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SideLabel {
    pub side: String,
}

pub struct NodeMetrics {
    registry: Registry,
    pub kv_pages_total: Family<ModelLabel, Gauge>,
    pub kv_pages_free: Family<ModelLabel, Gauge>,
    pub kv_pages_reserved: Family<ModelLabel, Gauge>,
    pub kv_pages_cached: Family<ModelLabel, Gauge>,
    pub prefix_cache_hits: Family<ModelLabel, Counter>,
    pub prefix_cache_misses: Family<ModelLabel, Counter>,
    pub prefix_cache_evictions: Family<ModelLabel, Counter>,
    pub queue_depth: Family<ModelLabel, Gauge>,
    pub running: Family<ModelLabel, Gauge>,
    pub admissions_rejected: Family<RejectLabel, Counter>,
    pub isolation_violations: Family<ModelLabel, Counter>,
    pub tokens_generated: Family<ModelLabel, Counter>,
    pub requests_completed: Family<ModelLabel, Counter>,
    pub embeddings: Family<ModelLabel, Counter>,
    pub ttft_seconds: Family<ModelLabel, Histogram>,
    pub inter_token_seconds: Family<ModelLabel, Histogram>,
    pub transfers_started: Family<SideLabel, Counter>,
    pub transfers_committed: Family<SideLabel, Counter>,
    pub transfers_failed: Family<TransferLabel, Counter>,
    pub transfer_bytes: Family<SideLabel, Counter>,
    pub transfer_verification_failures: Family<TransferLabel, Counter>,
    pub transfer_seconds: Family<SideLabel, Histogram>,
    /// Calls to the node API without its API token.
    pub unauthorized_requests: Counter,
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("bulkhead");
        let m = NodeMetrics {
            kv_pages_total: Family::default(),
            kv_pages_free: Family::default(),
            kv_pages_reserved: Family::default(),
            kv_pages_cached: Family::default(),
            prefix_cache_hits: Family::default(),
            prefix_cache_misses: Family::default(),
            prefix_cache_evictions: Family::default(),
            queue_depth: Family::default(),
            running: Family::default(),
            admissions_rejected: Family::default(),
            isolation_violations: Family::default(),
            tokens_generated: Family::default(),
            requests_completed: Family::default(),
            embeddings: Family::default(),
            ttft_seconds: Family::new_with_constructor(latency_histogram),
            inter_token_seconds: Family::new_with_constructor(latency_histogram),
            transfers_started: Family::default(),
            transfers_committed: Family::default(),
            transfers_failed: Family::default(),
            transfer_bytes: Family::default(),
            transfer_verification_failures: Family::default(),
            transfer_seconds: Family::new_with_constructor(latency_histogram),
            unauthorized_requests: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "kv_pages_total",
            "KV pool pages in all",
            m.kv_pages_total.clone(),
        );
        registry.register(
            "kv_pages_free",
            "KV pool pages no sequence holds (free, or cached and evictable)",
            m.kv_pages_free.clone(),
        );
        registry.register(
            "kv_pages_cached",
            "KV pages kept by the prefix cache, held or not",
            m.kv_pages_cached.clone(),
        );
        registry.register(
            "prefix_cache_hits",
            "Prompt pages found in the prefix cache of the request's namespace",
            m.prefix_cache_hits.clone(),
        );
        registry.register(
            "prefix_cache_misses",
            "Prompt pages looked up in the prefix cache and not found",
            m.prefix_cache_misses.clone(),
        );
        registry.register(
            "prefix_cache_evictions",
            "Cached pages evicted (poisoned) to make room",
            m.prefix_cache_evictions.clone(),
        );
        registry.register(
            "kv_pages_reserved",
            "KV pages promised to admitted sequences, not yet allocated",
            m.kv_pages_reserved.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests waiting for KV capacity",
            m.queue_depth.clone(),
        );
        registry.register(
            "running_sequences",
            "Sequences being generated",
            m.running.clone(),
        );
        registry.register(
            "admissions_rejected",
            "Requests refused at admission, by reason",
            m.admissions_rejected.clone(),
        );
        registry.register(
            "kv_isolation_violations",
            "KV page reads or writes refused because the page belongs to another sequence (alarm: must stay 0)",
            m.isolation_violations.clone(),
        );
        registry.register(
            "tokens_generated",
            "Completion tokens generated",
            m.tokens_generated.clone(),
        );
        registry.register(
            "requests_completed",
            "Generation requests that finished successfully",
            m.requests_completed.clone(),
        );
        registry.register("embeddings", "Texts embedded", m.embeddings.clone());
        registry.register(
            "time_to_first_token_seconds",
            "Time to first token",
            m.ttft_seconds.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            m.inter_token_seconds.clone(),
        );
        registry.register(
            "kv_transfers_started",
            "KV transfers begun (send: prefill side, receive: decode side)",
            m.transfers_started.clone(),
        );
        registry.register(
            "kv_transfers_committed",
            "KV transfers acknowledged by the decode node",
            m.transfers_committed.clone(),
        );
        registry.register(
            "kv_transfers_failed",
            "KV transfers rolled back, by reason",
            m.transfers_failed.clone(),
        );
        registry.register(
            "kv_transfer_bytes",
            "KV page bytes sent or received",
            m.transfer_bytes.clone(),
        );
        registry.register(
            "kv_transfer_verification_failures",
            "Received KV refused by verification (checksum, counts, owner), by reason",
            m.transfer_verification_failures.clone(),
        );
        registry.register(
            "kv_transfer_seconds",
            "Time of a committed KV transfer, handshake to acknowledgement",
            m.transfer_seconds.clone(),
        );
        registry.register(
            "node_unauthorized_requests",
            "Calls to the node API refused for a missing or wrong API token",
            m.unauthorized_requests.clone(),
        );
        NodeMetrics { registry, ..m }
    }

    pub fn reject(&self, model: &str, reason: &str) {
        self.admissions_rejected
            .get_or_create(&RejectLabel {
                model: model.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Count a failed transfer on `side` ("send" or "receive").
    pub fn transfer_failed(&self, side: &str, e: &crate::error::RuntimeError) {
        let reason = match e {
            crate::error::RuntimeError::Transfer(t) => {
                if t.is_verification_failure() {
                    self.transfer_verification_failures
                        .get_or_create(&TransferLabel {
                            side: side.into(),
                            reason: t.reason().into(),
                        })
                        .inc();
                }
                t.reason()
            }
            other => other.code(),
        };
        self.transfers_failed
            .get_or_create(&TransferLabel {
                side: side.into(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

pub fn label(model: &str) -> ModelLabel {
    ModelLabel {
        model: model.to_string(),
    }
}

pub fn side(side: &str) -> SideLabel {
    SideLabel { side: side.into() }
}
