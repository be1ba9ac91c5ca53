//! `bulkhead worker build WORKER.js -o WORKER.wasm`: a JS worker to a component, offline,
//! with the npm packages in `workers-js/` (componentize-js and its SpiderMonkey engine,
//! jco, esbuild), installed there with `npm ci` on first use.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The `workers-js/` directory: `$BULKHEAD_WORKERS_JS`, else the one in this source tree.
pub fn workers_js_dir() -> PathBuf {
    std::env::var_os("BULKHEAD_WORKERS_JS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../workers-js"))
}

fn newer(a: &Path, b: &Path) -> bool {
    let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    match (m(a), m(b)) {
        (Some(a), Some(b)) => a > b,
        _ => false,
    }
}

/// Installs the locked npm packages when they are missing or older than the lock file.
pub fn ensure_packages(dir: &Path) -> anyhow::Result<()> {
    let installed = dir.join("node_modules/.package-lock.json");
    if newer(&installed, &dir.join("package-lock.json")) {
        return Ok(());
    }
    eprintln!(
        "installing the worker build packages into {} (npm ci)",
        dir.display()
    );
    let status = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
        .current_dir(dir)
        .status()
        .context("running npm (bulkhead worker build needs Node.js 20+ and npm)")?;
    if !status.success() {
        bail!("npm ci in {} failed ({status})", dir.display());
    }
    Ok(())
}

pub fn build_js(input: &Path, output: &Path) -> anyhow::Result<()> {
    let dir = workers_js_dir();
    let dir = dir
        .canonicalize()
        .with_context(|| format!("the worker build kit is missing at {}", dir.display()))?;
    if !input.is_file() {
        bail!("{} is not a file", input.display());
    }
    ensure_packages(&dir)?;
    let abs = |p: &Path| -> anyhow::Result<PathBuf> {
        Ok(if p.is_absolute() {
            p.to_path_buf()
        } else {
            std::env::current_dir()?.join(p)
        })
    };
    let status = Command::new("node")
        .arg(dir.join("build.mjs"))
        .arg(abs(input)?)
        .arg("-o")
        .arg(abs(output)?)
        .current_dir(&dir)
        .status()
        .context("running node (bulkhead worker build needs Node.js 20+)")?;
    if !status.success() {
        bail!("building {} failed ({status})", input.display());
    }
    Ok(())
}
