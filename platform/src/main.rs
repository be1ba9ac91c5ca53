//! The `bulkhead` command: serve, node, check, models.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use bulkhead_platform::config::ServeConfig;
use bulkhead_runtime::models::fetch::{BUNDLED, default_cache_dir, fetch_all};
use bulkhead_runtime::node::{Node, NodeConfig, Role};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "bulkhead",
    version,
    about = "Multi-tenant edge inference platform"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the control plane with an embedded inference node (the single-machine default:
    /// SQLite under the data dir, bundled models).
    Serve(ServeArgs),
    /// Run an inference node serving its models over the node API.
    Node(NodeArgs),
    /// Pre-deployment check of a node configuration: exits non-zero, with the numbers, when a
    /// KV pool is smaller than a served model's context window times the safety factor.
    Check {
        #[arg(long)]
        config: PathBuf,
    },
    /// What this machine offers a node, as JSON: the kernels its quantized matmuls use, the
    /// device models run on, and the GPUs the CUDA driver reports (loaded at run time; none
    /// without a driver) with their total and free memory.
    Devices,
    /// Print a fresh KV transfer key (64 hex digits) for a cluster's prefill and decode
    /// nodes: `bulkhead transfer-key > transfer.key && chmod 600 transfer.key`.
    TransferKey,
    /// Manage the local model cache.
    Models {
        #[command(subcommand)]
        command: ModelsCommand,
    },
    /// Tenants' workers.
    Worker {
        #[command(subcommand)]
        command: WorkerCommand,
    },
}

#[derive(Subcommand)]
enum WorkerCommand {
    /// Compile a JS worker (`export default { async fetch(request, env, ctx) }`) into a
    /// WebAssembly component with componentize-js, offline. Needs Node.js 20+ and npm; the
    /// npm packages are installed into workers-js/node_modules on first use.
    Build {
        /// The worker's JavaScript module.
        input: PathBuf,
        /// Where to write the component.
        #[arg(short, long)]
        output: PathBuf,
    },
}

#[derive(Subcommand)]
enum ModelsCommand {
    /// Fetch the bundled models into the cache ($BULKHEAD_MODELS).
    Fetch,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Configuration (TOML); environment variables and flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long, env = "BULKHEAD_LISTEN")]
    listen: Option<SocketAddr>,
    /// Data directory (the default SQLite database lives here).
    #[arg(long, env = "BULKHEAD_DATA")]
    data: Option<PathBuf>,
    /// `sqlite://...` or `postgres://...`.
    #[arg(long, env = "BULKHEAD_DATABASE_URL")]
    database_url: Option<String>,
    /// Redis (optional): shared rate limits and catalog-change fan-out across replicas.
    #[arg(long, env = "BULKHEAD_REDIS_URL")]
    redis_url: Option<String>,
    /// The admin token (generated and printed once on first boot when unset).
    #[arg(long, env = "BULKHEAD_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Minimum ratio of KV pool tokens to a model's context window (at least 1.0).
    #[arg(long)]
    safety_factor: Option<f64>,
}

#[derive(clap::Args)]
struct NodeArgs {
    /// Node configuration (TOML); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    role: Option<Role>,
    #[arg(long, env = "BULKHEAD_NODE_LISTEN", default_value = "127.0.0.1:8788")]
    listen: SocketAddr,
    /// KV pool capacity in tokens per text model.
    #[arg(long)]
    pool_tokens: Option<usize>,
    /// Minimum ratio of pool tokens to a model's context window (at least 1.0).
    #[arg(long)]
    safety_factor: Option<f64>,
    /// Serve the text model with this context window (at most the model's own).
    #[arg(long)]
    context_window: Option<usize>,
    /// Control-plane replica to register with (heartbeats every second); repeat it, or
    /// separate URLs with commas, to tell every replica.
    #[arg(long, value_delimiter = ',')]
    control_plane: Vec<String>,
    /// The URL the control plane reaches this node at (default: http://<listen>).
    #[arg(long)]
    advertise: Option<String>,
    /// This node's id in the registry: the id its node token was minted for.
    #[arg(long, env = "BULKHEAD_NODE_ID")]
    node_id: Option<String>,
    /// The node's credential for the control plane: a node token minted for --node-id
    /// (`POST /admin/v1/nodes/{id}/tokens`), never the admin token.
    #[arg(long, env = "BULKHEAD_NODE_TOKEN", hide_env_values = true)]
    node_token: Option<String>,
    /// The token callers of this node's API must present (24 to 256 printable characters).
    /// Default: a fresh random one, handed to the control plane in the heartbeat.
    #[arg(long, env = "BULKHEAD_NODE_API_TOKEN", hide_env_values = true)]
    api_token: Option<String>,
    /// Decode role: accept KV transfers from prefill nodes on this address.
    #[arg(long)]
    transfer_listen: Option<String>,
    /// Prefill role: a decode node's transfer address (repeat for several).
    #[arg(long)]
    decode_peer: Vec<String>,
    /// Page bytes per KV transfer batch.
    #[arg(long)]
    transfer_batch_bytes: Option<usize>,
    /// Longest a KV transfer may take before both sides roll it back, in milliseconds.
    #[arg(long)]
    transfer_lease_ms: Option<u64>,
    /// The cluster's KV transfer key file (`bulkhead transfer-key`); required by prefill
    /// and decode nodes.
    #[arg(long, env = "BULKHEAD_TRANSFER_KEY_FILE")]
    transfer_key_file: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    // SAFETY: first thing in `main`, before any thread exists.
    unsafe { bulkhead_platform::init_compute_threads() };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Models {
            command: ModelsCommand::Fetch,
        } => fetch_all(&default_cache_dir()),
        Command::Check { config } => check(&config),
        Command::TransferKey => {
            println!(
                "{}",
                bulkhead_runtime::transfer::TransferKey::generate().to_hex()
            );
            Ok(())
        }
        Command::Devices => devices(),
        Command::Node(args) => run_node(args),
        Command::Serve(args) => run_serve(args),
        Command::Worker {
            command: WorkerCommand::Build { input, output },
        } => bulkhead_platform::workers::build::build_js(&input, &output),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn devices() -> anyhow::Result<()> {
    use bulkhead_runtime::device;
    let report = serde_json::json!({
        "matmul_kernels": bulkhead_runtime::kernels::matmul_path(),
        "models_device": device::name(&device::select()?),
        "gpus": device::discover_gpus(),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn load_config(path: Option<&PathBuf>) -> anyhow::Result<NodeConfig> {
    match path {
        None => Ok(NodeConfig::default()),
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            NodeConfig::from_toml(&text).with_context(|| format!("parsing {}", p.display()))
        }
    }
}

fn check(path: &PathBuf) -> anyhow::Result<()> {
    let cfg = load_config(Some(path))?;
    // Windows of the bundled models, so a config may omit them.
    let windows = [(bulkhead_runtime::node::SMOLLM2_NAME.to_string(), 8192usize)].into();
    bulkhead_runtime::node::check_config(&cfg, &windows)?;
    println!(
        "ok: every KV pool fits its models' context windows x {}",
        cfg.safety_factor
    );
    Ok(())
}

fn run_node(args: NodeArgs) -> anyhow::Result<()> {
    let mut cfg = load_config(args.config.as_ref())?;
    if let Some(r) = args.role {
        cfg.role = r;
    }
    if let Some(t) = args.pool_tokens {
        cfg.pool_tokens = Some(t);
    }
    if let Some(f) = args.safety_factor {
        cfg.safety_factor = f;
    }
    if let Some(w) = args.context_window {
        for m in &mut cfg.text_models {
            m.context_window = Some(w);
        }
    }
    if let Some(l) = args.transfer_listen {
        cfg.transfer.listen = Some(l);
    }
    if !args.decode_peer.is_empty() {
        cfg.transfer.peers = args.decode_peer;
    }
    if let Some(b) = args.transfer_batch_bytes {
        cfg.transfer.batch_bytes = b;
    }
    if let Some(l) = args.transfer_lease_ms {
        cfg.transfer.lease_ms = l;
    }
    if let Some(k) = args.transfer_key_file {
        cfg.transfer.key_file = Some(k);
    }
    cfg.transfer.load_key()?;
    match args.api_token {
        Some(t) => {
            cfg.api_token =
                Some(bulkhead_runtime::node_auth::ApiToken::new(t).context("--api-token")?)
        }
        None if args.control_plane.is_empty() => tracing::warn!(
            "no --api-token and no --control-plane: this node's API accepts no caller"
        ),
        None => {}
    }
    // The bundled defaults fetch themselves on first run.
    let cache = cfg.models_dir();
    if BUNDLED.iter().any(|p| !p.is_present(&cache)) {
        fetch_all(&cache)?;
    }
    let node = Arc::new(Node::start(&cfg)?);
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let local = listener.local_addr()?;
        tracing::info!("node ({:?}) listening on http://{local}", cfg.role);
        if let Some(addr) = &cfg.transfer.listen {
            let tl = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the transfer address {addr}"))?;
            tracing::info!("accepting KV transfers on {}", tl.local_addr()?);
            tokio::spawn(bulkhead_runtime::transfer::receiver::serve(
                tl,
                node.clone(),
                cfg.transfer.clone(),
            ));
        }
        if !args.control_plane.is_empty() {
            let cps = args.control_plane;
            let token = args
                .node_token
                .context("--control-plane needs a token (--node-token or BULKHEAD_NODE_TOKEN)")?;
            let id = args
                .node_id
                .context("--control-plane needs the node's id (--node-id or BULKHEAD_NODE_ID), the one its node token was minted for")?;
            let address = args.advertise.unwrap_or_else(|| format!("http://{local}"));
            tracing::info!(node_id = %id, "registering with the control plane at {}", cps.join(", "));
            tokio::spawn(bulkhead_platform::nodes::run_heartbeats(
                cps,
                token,
                id,
                address,
                node.clone(),
            ));
        }
        bulkhead_runtime::server::serve(node, listener, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
        Ok(())
    })
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut cfg = match &args.config {
        None => ServeConfig::default(),
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            ServeConfig::from_toml(&text).with_context(|| format!("parsing {}", p.display()))?
        }
    };
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    if let Some(d) = args.data {
        cfg.data_dir = Some(d);
    }
    if let Some(u) = args.database_url {
        cfg.database_url = Some(u);
    }
    if let Some(t) = args.admin_token {
        cfg.admin_token = Some(t);
    }
    if let Some(r) = args.redis_url {
        cfg.redis_url = Some(r);
    }
    if let Some(f) = args.safety_factor {
        cfg.node.safety_factor = f;
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let (state, generated) = bulkhead_platform::serve::build(&cfg).await?;
        if let Some(token) = generated {
            // Shown once; only its hash is stored.
            println!("admin token (shown once, store it now): {token}");
        }
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("binding {}", cfg.listen))?;
        tracing::info!(
            "control plane listening on http://{}",
            listener.local_addr()?
        );
        bulkhead_platform::serve::run(state, listener, shutdown_signal()).await?;
        tracing::info!("drained; bye");
        Ok(())
    })
}

/// Ctrl-C or SIGTERM: stop accepting, let in-flight requests finish.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
