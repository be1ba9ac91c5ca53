//! The worker host: tenants' WebAssembly components (JS built with componentize-js, or any
//! language) run on wasmtime, one fresh instance per request from a pre-instantiated
//! template, with CPU-time, wall-clock, memory, AI-call and body-size limits. Their AI calls
//! go through the Workers AI adapter (`crate::api::workers_ai`) as the tenant that owns the worker.
//!
//! Components are validated and compiled once at deploy; the compiled code is serialised
//! (wasmtime's precompiled format) into the database next to the component, and into a file
//! under the data dir that is loaded with `mmap`. A restart, or another replica, loads that
//! copy instead of compiling again; a replica whose engine differs (another wasmtime or CPU)
//! compiles once and stores its own copy.
//!
//! Trust: precompiled code is native code. It is only ever produced by this host: the
//! database copy is checked against its SHA-256 before it is written to the local cache,
//! and the local cache directory is the platform's own.

pub mod ai;
pub mod build;
pub mod invoke;
pub mod metrics;
pub mod sandbox;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use parking_lot::{Mutex, RwLock};
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};
use wasmtime_wasi_http::p2::bindings::ProxyPre;

use crate::envelope::ApiError;
use crate::store::{Store, WorkerArtifact, WorkerInfo, WorkerSettings};
pub use metrics::WorkerMetrics;
use sandbox::WorkerState;

/// Operator settings of the worker host (`[workers]` in the serve config): the defaults a
/// deploy gets and the most it may ask for.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkersConfig {
    /// Largest component a tenant may upload.
    pub max_component_bytes: usize,
    pub default_cpu_ms: i64,
    pub max_cpu_ms: i64,
    pub default_memory_mib: i64,
    pub max_memory_mib: i64,
    pub default_wall_ms: i64,
    pub max_wall_ms: i64,
    pub default_ai_calls: i64,
    pub max_ai_calls: i64,
    /// Largest request body a worker is given.
    pub max_request_bytes: usize,
    /// Largest response body a worker may send.
    pub max_response_bytes: usize,
    /// Pre-allocated instance slots (wasmtime's pooling allocator), the most worker
    /// requests running at once; 0 allocates on demand, without a bound. A request that
    /// finds every slot busy gets 503/3040.
    pub pool_slots: u32,
    /// MiB of each pooled linear memory and table whose dirtied pages stay mapped between
    /// instances (reset by copying the image back; Linux 6.7+, otherwise 0 is used).
    pub keep_resident_mib: usize,
    /// Compiled workers kept in memory.
    pub loaded_max: usize,
    /// Deploys compiling at once (compiling a JS worker takes seconds of CPU).
    pub compile_concurrency: usize,
    /// Epoch tick: the granularity of the CPU-time limit.
    pub tick_ms: u64,
}

impl Default for WorkersConfig {
    fn default() -> Self {
        WorkersConfig {
            max_component_bytes: 32 << 20,
            default_cpu_ms: 50,
            max_cpu_ms: 30_000,
            default_memory_mib: 128,
            max_memory_mib: 512,
            default_wall_ms: 30_000,
            max_wall_ms: 300_000,
            default_ai_calls: 16,
            max_ai_calls: 256,
            max_request_bytes: 1 << 20,
            max_response_bytes: 16 << 20,
            pool_slots: 64,
            keep_resident_mib: 16,
            loaded_max: 256,
            compile_concurrency: 1,
            tick_ms: 1,
        }
    }
}

/// The optional settings of a deploy (`?cpu_ms=&memory_mib=&wall_ms=&ai_calls=`).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SettingsQuery {
    /// Guest CPU time per request in ms (default 50).
    pub cpu_ms: Option<i64>,
    /// Memory per instance in MiB, all its linear memories and tables together (default 128).
    pub memory_mib: Option<i64>,
    /// Wall-clock time per request in ms (default 30000).
    pub wall_ms: Option<i64>,
    /// AI calls per request (default 16).
    pub ai_calls: Option<i64>,
}

impl WorkersConfig {
    /// The settings of a deploy: the defaults, overridden by what it asks for within the
    /// maxima; 400/10022 outside them.
    pub fn settings(&self, q: &SettingsQuery) -> Result<WorkerSettings, ApiError> {
        let pick = |name: &str, v: Option<i64>, default: i64, max: i64| {
            let v = v.unwrap_or(default);
            if v < 1 || v > max {
                return Err(bad_settings(format!("{name} {v} is outside 1..={max}")));
            }
            Ok(v)
        };
        Ok(WorkerSettings {
            cpu_ms: pick("cpu_ms", q.cpu_ms, self.default_cpu_ms, self.max_cpu_ms)?,
            memory_mib: pick(
                "memory_mib",
                q.memory_mib,
                self.default_memory_mib,
                self.max_memory_mib,
            )?,
            wall_ms: pick("wall_ms", q.wall_ms, self.default_wall_ms, self.max_wall_ms)?,
            ai_calls: pick(
                "ai_calls",
                q.ai_calls,
                self.default_ai_calls,
                self.max_ai_calls,
            )?,
        })
    }
}

/// Error codes of the workers API and of worker invocations. Stable: documented in README.
pub mod codes {
    /// 500: the worker trapped, threw, or returned without a response.
    pub const EXCEPTION: u32 = 1101;
    /// 503: the worker used up its CPU time.
    pub const CPU_LIMIT: u32 = 1102;
    /// 503: the request ran past its wall-clock limit.
    pub const WALL_LIMIT: u32 = 1103;
    /// 404: no such worker.
    pub const NOT_FOUND: u32 = 10007;
    /// 500: the worker went over its memory limit.
    pub const MEMORY_LIMIT: u32 = 1106;
    /// 500: the worker's response is larger than the limit.
    pub const RESPONSE_TOO_LARGE: u32 = 1107;
    /// 400: the upload is not a valid worker component.
    pub const INVALID_COMPONENT: u32 = 10021;
    /// 400: bad worker name or settings.
    pub const BAD_SETTINGS: u32 = 10022;
    /// 400: the upload is larger than the limit.
    pub const TOO_LARGE: u32 = 10027;
}

fn bad_settings(message: impl Into<String>) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        codes::BAD_SETTINGS,
        "bad_worker_settings",
        message,
    )
}

fn invalid_component(message: impl Into<String>) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        codes::INVALID_COMPONENT,
        "invalid_component",
        message,
    )
}

pub fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        codes::TOO_LARGE,
        "component_too_large",
        format!("the component is larger than the limit of {limit} bytes"),
    )
}

pub fn not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        codes::NOT_FOUND,
        "worker_not_found",
        format!("worker {name} not found"),
    )
}

/// A worker name: a DNS label (it is also the first label of the worker's host name).
pub fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(bad_settings(format!(
            "worker name {name:?} must be 1-63 of a-z, 0-9 and '-', not starting or ending with '-'"
        )))
    }
}

/// A compiled worker, ready to instantiate.
pub struct Loaded {
    pub pre: ProxyPre<WorkerState>,
    last_used: Mutex<Instant>,
}

/// How a deploy went, for its answer.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct DeployStats {
    pub compile_ms: f64,
    pub artifact_bytes: usize,
}

pub struct WorkerHost {
    engine: Engine,
    linker: Linker<WorkerState>,
    /// The engine's precompile-compatibility hash: which stored artifacts this host can load.
    engine_hash: String,
    pub cfg: WorkersConfig,
    cache_dir: PathBuf,
    /// Every worker of every tenant (metadata only), by (tenant, name).
    index: RwLock<HashMap<(String, String), WorkerInfo>>,
    index_version: Mutex<i64>,
    /// Compiled components by component SHA-256 (shared by identical uploads).
    loaded: Mutex<HashMap<String, Arc<Loaded>>>,
    /// One load at a time per component.
    loading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    compile_gate: tokio::sync::Semaphore,
    pub metrics: WorkerMetrics,
    pub tick: Duration,
    /// Told each time a request's store has dropped and so freed its pooled instance slot,
    /// for requests that found every slot taken (see `invoke`).
    pub slot_freed: tokio::sync::Notify,
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// What kind of WebAssembly binary `bytes` is, from its preamble.
fn check_preamble(bytes: &[u8]) -> Result<(), ApiError> {
    match bytes.get(..8) {
        Some([0, b'a', b's', b'm', 0x0d, 0x00, 0x01, 0x00]) => Ok(()),
        Some([0, b'a', b's', b'm', 0x01, 0x00, 0x00, 0x00]) => Err(invalid_component(
            "this is a core WebAssembly module, not a component: build it into a component \
             (bulkhead worker build for JS, or wasm-tools component new)",
        )),
        _ => Err(invalid_component(
            "this is not a WebAssembly component (bad preamble)",
        )),
    }
}

/// The wasmtime engine for workers: components, epoch interruption (the CPU limit),
/// copy-on-write memory images, and with `pool_slots` the pooling allocator. A pooled slot
/// keeps up to `keep_resident_mib` of the pages its last instance dirtied mapped and copies
/// them back to the image on reset (found with `PAGEMAP_SCAN`, required by `pagemap`
/// `Yes`; the wasmtime vendored in `third_party/` reads up to 1024 dirty regions per scan
/// where stock 48 stopped at 32 and decommitted the rest), so the next instance does not
/// take a copy-on-write fault, and a TLB shootdown across cores, on each of them again.
/// Either way every instance starts from the pristine image: nothing of one request is
/// visible to the next.
fn build_engine(cfg: &WorkersConfig, pagemap: Enabled) -> anyhow::Result<Engine> {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.epoch_interruption(true);
    config.parallel_compilation(true);
    config.memory_init_cow(true);
    if std::env::var_os("BULKHEAD_WASM_PERFMAP").is_some() {
        // For profiling guests with `perf`: JIT symbols in /tmp/perf-PID.map.
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    if cfg.pool_slots > 0 {
        let mut pool = PoolingAllocationConfig::default();
        let slots = cfg.pool_slots;
        let keep = cfg.keep_resident_mib << 20;
        pool.total_component_instances(slots)
            .total_core_instances(slots * 8)
            .total_memories(slots * 2)
            .total_tables(slots * 8)
            .total_stacks(slots)
            .max_memory_size((cfg.max_memory_mib as usize) << 20)
            .max_core_instances_per_component(32)
            .max_memories_per_component(4)
            .max_tables_per_component(16)
            .table_elements(100_000)
            .max_core_instance_size(4 << 20)
            .max_component_instance_size(4 << 20)
            .max_unused_warm_slots(slots)
            .linear_memory_keep_resident(keep)
            .table_keep_resident(keep);
        if keep > 0 {
            pool.pagemap_scan(pagemap);
        }
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    }
    Engine::new(&config).map_err(|e| anyhow::anyhow!("{e:#}"))
}

impl WorkerHost {
    /// The engine, its linker (WASI p2, `wasi:http` with outgoing requests denied, and the
    /// AI binding) and the epoch ticker thread.
    pub fn new(cfg: WorkersConfig, data_dir: &Path) -> anyhow::Result<Arc<WorkerHost>> {
        let engine = match build_engine(&cfg, Enabled::Yes) {
            Ok(engine) => engine,
            Err(e) if cfg.pool_slots > 0 && cfg.keep_resident_mib > 0 => {
                // Without PAGEMAP_SCAN (Linux 6.7+) wasmtime would copy the first
                // `keep_resident` bytes back on every reset, dirty or not: slower than
                // letting the pages fault back in, so keep nothing resident.
                tracing::info!(
                    "worker instance pool: no engine with PAGEMAP_SCAN ({e:#}); trying again \
                     without keeping instance memory resident between requests"
                );
                let cfg = WorkersConfig {
                    keep_resident_mib: 0,
                    ..cfg.clone()
                };
                build_engine(&cfg, Enabled::No)?
            }
            Err(e) => return Err(e),
        };
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker)
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        ai::add_to_linker::<_, HasSelf<WorkerState>>(&mut linker, |s| s)
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        ai::add_runtime_to_linker::<_, HasSelf<WorkerState>>(&mut linker, |s| s)
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let engine_hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            engine.precompile_compatibility_hash().hash(&mut h);
            format!("wasmtime-48-{:016x}", h.finish())
        };
        let tick = Duration::from_millis(cfg.tick_ms.max(1));
        let weak = engine.weak();
        std::thread::Builder::new()
            .name("worker-epoch".into())
            .spawn(move || {
                while let Some(engine) = weak.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    std::thread::sleep(tick);
                }
            })?;
        Ok(Arc::new(WorkerHost {
            engine,
            linker,
            engine_hash,
            compile_gate: tokio::sync::Semaphore::new(cfg.compile_concurrency.max(1)),
            cache_dir: data_dir.join("worker-cache"),
            cfg,
            index: RwLock::new(HashMap::new()),
            index_version: Mutex::new(-1),
            loaded: Mutex::new(HashMap::new()),
            loading: Mutex::new(HashMap::new()),
            metrics: WorkerMetrics::new(),
            tick,
            slot_freed: tokio::sync::Notify::new(),
        }))
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn engine_hash(&self) -> &str {
        &self.engine_hash
    }

    /// The worker's metadata as this replica knows it.
    pub fn info(&self, tenant: &str, name: &str) -> Option<WorkerInfo> {
        self.index
            .read()
            .get(&(tenant.to_string(), name.to_string()))
            .cloned()
    }

    /// Reloads the index when the stored version moved; drops compiled components no
    /// worker uses any more. Returns whether it reloaded.
    pub async fn refresh(&self, store: &Store) -> Result<bool, crate::store::StoreError> {
        let version = store.workers_version().await?;
        if *self.index_version.lock() == version {
            return Ok(false);
        }
        let all = store.list_workers(None).await?;
        let index: HashMap<_, _> = all
            .into_iter()
            .map(|w| ((w.tenant_id.clone(), w.name.clone()), w))
            .collect();
        {
            let mut v = self.index_version.lock();
            if *v >= version {
                return Ok(false);
            }
            *v = version;
            *self.index.write() = index;
        }
        self.collect();
        Ok(true)
    }

    /// Polls the stored version every 200 ms, so a deploy or delete on another replica is
    /// seen here within about that.
    pub fn spawn_refresher(self: &Arc<Self>, store: Store) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let Some(host) = weak.upgrade() else { break };
                if let Err(e) = host.refresh(&store).await {
                    tracing::warn!("worker index refresh failed: {e}");
                }
            }
        });
    }

    /// Drops compiled components that no indexed worker uses.
    fn collect(&self) {
        let used: std::collections::HashSet<String> = self
            .index
            .read()
            .values()
            .map(|w| w.sha256.clone())
            .collect();
        self.loaded.lock().retain(|sha, _| used.contains(sha));
    }

    fn artifact_path(&self, sha: &str) -> PathBuf {
        self.cache_dir
            .join(format!("{sha}-{}.cwasm", self.engine_hash))
    }

    /// Writes a precompiled copy atomically (temporary file, then rename).
    fn write_artifact(&self, sha: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(&self.cache_dir)?;
        let path = self.artifact_path(sha);
        let tmp = self.cache_dir.join(format!(
            ".{sha}-{}.{}.tmp",
            std::process::id(),
            uuid::Uuid::new_v4()
        ));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    fn prepare(&self, component: &Component) -> Result<ProxyPre<WorkerState>, ApiError> {
        let pre = self.linker.instantiate_pre(component).map_err(|e| {
            invalid_component(format!(
                "the component imports something workers cannot use: {e:#}"
            ))
        })?;
        ProxyPre::new(pre).map_err(|e| {
            invalid_component(format!(
                "the component does not export wasi:http/incoming-handler@0.2.x: {e:#}"
            ))
        })
    }

    /// Validates and compiles an upload: a component of the worker world (its imports within
    /// what the host provides, the HTTP handler exported). Returns the template and the
    /// serialised compiled code.
    async fn compile(
        self: &Arc<Self>,
        bytes: Arc<Vec<u8>>,
    ) -> Result<(ProxyPre<WorkerState>, Vec<u8>, Duration), ApiError> {
        check_preamble(&bytes)?;
        let _permit = self
            .compile_gate
            .acquire()
            .await
            .map_err(ApiError::internal)?;
        let host = self.clone();
        tokio::task::spawn_blocking(move || {
            let start = Instant::now();
            let component = Component::new(&host.engine, bytes.as_slice())
                .map_err(|e| invalid_component(format!("the component does not compile: {e:#}")))?;
            let took = start.elapsed();
            let pre = host.prepare(&component)?;
            let artifact = component.serialize().map_err(ApiError::internal)?;
            Ok((pre, artifact, took))
        })
        .await
        .map_err(ApiError::internal)?
    }

    /// `PUT .../workers/scripts/{name}`: validate, compile, store component and artifact,
    /// and make it live here at once (other replicas within their next poll).
    pub async fn deploy(
        self: &Arc<Self>,
        store: &Store,
        tenant: &str,
        name: &str,
        bytes: Vec<u8>,
        settings: WorkerSettings,
    ) -> Result<(Option<WorkerInfo>, WorkerInfo, DeployStats), ApiError> {
        let bytes = Arc::new(bytes);
        let sha = sha256_hex(&bytes);
        let (pre, artifact, took) = match self.compile(bytes.clone()).await {
            Ok(v) => v,
            Err(e) => {
                self.metrics.deploy("invalid");
                return Err(e);
            }
        };
        let stored = WorkerArtifact {
            engine: self.engine_hash.clone(),
            sha256: sha256_hex(&artifact),
            bytes: artifact,
        };
        let (before, after) = store
            .put_worker(tenant, name, &sha, &bytes, settings, &stored)
            .await?;
        if let Err(e) = self.write_artifact(&sha, &stored.bytes) {
            tracing::warn!("worker cache: writing {sha}: {e}");
        }
        self.loaded.lock().insert(
            sha.clone(),
            Arc::new(Loaded {
                pre,
                last_used: Mutex::new(Instant::now()),
            }),
        );
        self.metrics.load("deploy", took.as_secs_f64());
        self.index
            .write()
            .insert((tenant.to_string(), name.to_string()), after.clone());
        self.metrics.deploy("ok");
        let stats = DeployStats {
            compile_ms: took.as_secs_f64() * 1e3,
            artifact_bytes: stored.bytes.len(),
        };
        Ok((before, after, stats))
    }

    /// `DELETE .../workers/scripts/{name}`.
    pub async fn delete(
        &self,
        store: &Store,
        tenant: &str,
        name: &str,
    ) -> Result<WorkerInfo, ApiError> {
        let removed = store
            .delete_worker(tenant, name)
            .await
            .map_err(|e| match e {
                crate::store::StoreError::NotFound(_) => not_found(name),
                other => other.into(),
            })?;
        self.index
            .write()
            .remove(&(tenant.to_string(), name.to_string()));
        self.collect();
        Ok(removed)
    }

    /// The compiled worker for `info`: in memory, else the local precompiled file, else the
    /// stored precompiled copy, else compiled again from the stored component.
    pub async fn load(
        self: &Arc<Self>,
        store: &Store,
        info: &WorkerInfo,
    ) -> Result<Arc<Loaded>, ApiError> {
        if let Some(l) = self.loaded.lock().get(&info.sha256) {
            *l.last_used.lock() = Instant::now();
            return Ok(l.clone());
        }
        let gate = self
            .loading
            .lock()
            .entry(info.sha256.clone())
            .or_default()
            .clone();
        let _one = gate.lock().await;
        if let Some(l) = self.loaded.lock().get(&info.sha256) {
            return Ok(l.clone());
        }
        let start = Instant::now();
        let (pre, source) = self.load_uncached(store, info).await?;
        self.metrics.load(source, start.elapsed().as_secs_f64());
        tracing::info!(
            worker = %info.name, tenant = %info.tenant_id, source,
            "worker loaded in {:.1} ms", start.elapsed().as_secs_f64() * 1e3
        );
        let loaded = Arc::new(Loaded {
            pre,
            last_used: Mutex::new(Instant::now()),
        });
        let mut map = self.loaded.lock();
        if map.len() >= self.cfg.loaded_max.max(1) {
            // Evict the least recently used.
            if let Some(oldest) = map
                .iter()
                .min_by_key(|(_, l)| *l.last_used.lock())
                .map(|(k, _)| k.clone())
            {
                map.remove(&oldest);
            }
        }
        map.insert(info.sha256.clone(), loaded.clone());
        drop(map);
        self.loading.lock().remove(&info.sha256);
        Ok(loaded)
    }

    async fn load_uncached(
        self: &Arc<Self>,
        store: &Store,
        info: &WorkerInfo,
    ) -> Result<(ProxyPre<WorkerState>, &'static str), ApiError> {
        let path = self.artifact_path(&info.sha256);
        if path.exists() {
            match self.load_file(path.clone()).await {
                Ok(pre) => return Ok((pre, "file")),
                Err(e) => {
                    tracing::warn!(
                        "worker cache: {} unusable, dropped: {}",
                        path.display(),
                        e.message
                    );
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        if let Some(a) = store
            .worker_artifact(&info.sha256, &self.engine_hash)
            .await?
        {
            if sha256_hex(&a.bytes) == a.sha256 {
                let path = self
                    .write_artifact(&info.sha256, &a.bytes)
                    .map_err(ApiError::internal)?;
                match self.load_file(path).await {
                    Ok(pre) => return Ok((pre, "database")),
                    Err(e) => {
                        tracing::warn!("stored artifact of {} unusable: {}", info.sha256, e.message)
                    }
                }
            } else {
                tracing::warn!("stored artifact of {} fails its checksum", info.sha256);
            }
        }
        let component = store
            .worker_component(&info.tenant_id, &info.name, &info.sha256)
            .await?
            .ok_or_else(|| not_found(&info.name))?;
        let (pre, artifact, _) = self.compile(Arc::new(component)).await?;
        let stored = WorkerArtifact {
            engine: self.engine_hash.clone(),
            sha256: sha256_hex(&artifact),
            bytes: artifact,
        };
        store.put_worker_artifact(&info.sha256, &stored).await?;
        if let Err(e) = self.write_artifact(&info.sha256, &stored.bytes) {
            tracing::warn!("worker cache: writing {}: {e}", info.sha256);
        }
        Ok((pre, "compile"))
    }

    async fn load_file(self: &Arc<Self>, path: PathBuf) -> Result<ProxyPre<WorkerState>, ApiError> {
        let host = self.clone();
        tokio::task::spawn_blocking(move || {
            // SAFETY: the file is a serialisation this host (or a replica with the same
            // engine) produced, kept in the platform's own cache directory, written there
            // atomically after its checksum was verified; wasmtime checks that it was made
            // for a compatible engine.
            let component = unsafe { Component::deserialize_file(&host.engine, &path) }
                .map_err(|e| ApiError::internal(format!("{e:#}")))?;
            host.prepare(&component)
        })
        .await
        .map_err(ApiError::internal)?
    }

    /// Drops every compiled component from memory (the next request loads it again).
    pub fn unload_all(&self) {
        self.loaded.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for ok in ["a", "hello-world", "x1", &"a".repeat(63)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a/b", "a_b", &"a".repeat(64)] {
            let e = check_name(bad).unwrap_err();
            assert_eq!(e.code, codes::BAD_SETTINGS, "{bad}");
        }
    }

    #[test]
    fn settings_take_defaults_and_stay_within_maxima() {
        let cfg = WorkersConfig::default();
        let s = cfg.settings(&SettingsQuery::default()).unwrap();
        assert_eq!(
            (s.cpu_ms, s.memory_mib, s.wall_ms, s.ai_calls),
            (50, 128, 30_000, 16)
        );
        let s = cfg
            .settings(&SettingsQuery {
                cpu_ms: Some(200),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(s.cpu_ms, 200);
        for q in [
            SettingsQuery {
                cpu_ms: Some(0),
                ..Default::default()
            },
            SettingsQuery {
                memory_mib: Some(513),
                ..Default::default()
            },
            SettingsQuery {
                ai_calls: Some(-1),
                ..Default::default()
            },
        ] {
            assert_eq!(cfg.settings(&q).unwrap_err().code, codes::BAD_SETTINGS);
        }
    }

    #[test]
    fn core_modules_and_garbage_are_not_components() {
        let core = [0, b'a', b's', b'm', 1, 0, 0, 0];
        assert!(
            check_preamble(&core)
                .unwrap_err()
                .message
                .contains("core WebAssembly module")
        );
        assert!(check_preamble(b"hello world").is_err());
        assert!(check_preamble(&[0, b'a', b's', b'm', 0x0d, 0, 1, 0]).is_ok());
    }
}
