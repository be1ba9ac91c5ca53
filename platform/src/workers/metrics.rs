//! Prometheus metrics of the worker host, appended to `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub source: String,
}

pub struct WorkerMetrics {
    registry: Registry,
    requests: Family<OutcomeLabel, Counter>,
    deploys: Family<OutcomeLabel, Counter>,
    loads: Family<SourceLabel, Counter>,
    load_seconds: Family<SourceLabel, Histogram>,
    ai_calls: Counter,
    ai_calls_refused: Counter,
    response_head_seconds: Histogram,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("bulkhead_worker");
        let m = WorkerMetrics {
            requests: Family::default(),
            deploys: Family::default(),
            loads: Family::default(),
            load_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 16))
            }),
            ai_calls: Counter::default(),
            ai_calls_refused: Counter::default(),
            response_head_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 20)),
            registry: Registry::default(),
        };
        registry.register(
            "requests",
            "Worker invocations by outcome: ok, exception (trap, uncaught error or no response), cpu_limit, wall_limit, memory_limit, request_too_large, response_too_large, overloaded, client_gone (the client left before the worker answered)",
            m.requests.clone(),
        );
        registry.register(
            "deploys",
            "Worker uploads by outcome: ok, invalid, too_large",
            m.deploys.clone(),
        );
        registry.register(
            "loads",
            "Compiled workers made ready, by source: deploy (just compiled), file (local precompiled copy), database (stored precompiled copy), compile (compiled again)",
            m.loads.clone(),
        );
        registry.register(
            "load_seconds",
            "Time to make a worker ready to instantiate, by source",
            m.load_seconds.clone(),
        );
        registry.register(
            "ai_calls",
            "AI binding calls made by workers",
            m.ai_calls.clone(),
        );
        registry.register(
            "ai_calls_refused",
            "AI binding calls refused for going over the per-request limit",
            m.ai_calls_refused.clone(),
        );
        registry.register(
            "response_head_seconds",
            "Time from a worker request's arrival to its response status and headers",
            m.response_head_seconds.clone(),
        );
        WorkerMetrics { registry, ..m }
    }

    pub fn request(&self, outcome: &str) {
        self.requests
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }

    pub fn requests(&self, outcome: &str) -> u64 {
        self.requests
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .get()
    }

    pub fn deploy(&self, outcome: &str) {
        self.deploys
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }

    pub fn load(&self, source: &str, seconds: f64) {
        let l = SourceLabel {
            source: source.into(),
        };
        self.loads.get_or_create(&l).inc();
        self.load_seconds.get_or_create(&l).observe(seconds);
    }

    pub fn loads(&self, source: &str) -> u64 {
        self.loads
            .get_or_create(&SourceLabel {
                source: source.into(),
            })
            .get()
    }

    pub fn ai_call(&self) {
        self.ai_calls.inc();
    }

    pub fn ai_call_refused(&self) {
        self.ai_calls_refused.inc();
    }

    pub fn response_head(&self, seconds: f64) {
        self.response_head_seconds.observe(seconds);
    }

    /// The text exposition of these metrics (without the final `# EOF`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode_registry(&mut out, &self.registry).is_err() {
            return String::new();
        }
        out
    }
}
