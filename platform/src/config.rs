//! Configuration of `bulkhead serve`: a TOML file, then `BULKHEAD_*` environment variables,
//! then flags, each overriding the one before.

use std::net::SocketAddr;
use std::path::PathBuf;

use bulkhead_runtime::node::NodeConfig;

use crate::limits::RateLimits;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    /// Where the embedded SQLite database lives (and anything else the platform keeps).
    pub data_dir: Option<PathBuf>,
    /// `sqlite://...` (default: under `data_dir`) or `postgres://...`.
    pub database_url: Option<String>,
    /// The admin token; generated and printed once on first boot when unset.
    pub admin_token: Option<String>,
    /// Redis for rate limits shared across replicas and catalog-change fan-out.
    pub redis_url: Option<String>,
    /// Prefix of every Redis key and channel.
    pub redis_prefix: String,
    pub limits: RateLimits,
    /// The embedded inference node (its `safety_factor` is also the catalog's publish gate).
    pub node: NodeConfig,
    /// Tenants' workers: limits, defaults and the instance pool.
    pub workers: crate::workers::WorkersConfig,
    /// How far a request's usage is written before its answer ends (`usage_journal`).
    pub usage_sync: crate::usage_journal::SyncMode,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: "127.0.0.1:8787".parse().expect("valid address"),
            data_dir: None,
            database_url: None,
            admin_token: None,
            redis_url: None,
            redis_prefix: "bulkhead".into(),
            limits: RateLimits::default(),
            node: NodeConfig::default(),
            workers: Default::default(),
            usage_sync: Default::default(),
        }
    }
}

impl ServeConfig {
    pub fn from_toml(text: &str) -> anyhow::Result<Self> {
        Ok(toml::from_str(text)?)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| dirs_data_dir().join("bulkhead"))
    }

    pub fn database_url(&self) -> String {
        self.database_url.clone().unwrap_or_else(|| {
            format!(
                "sqlite://{}?mode=rwc",
                self.data_dir().join("bulkhead.db").display()
            )
        })
    }
}

fn dirs_data_dir() -> PathBuf {
    std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(std::env::temp_dir)
}
