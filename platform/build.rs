//! Builds the admin UI (`web/`, Vite) when `web/dist` is missing or older than its sources,
//! and embeds `web/dist` into the binary (`src/web.rs` serves it at `/admin`).
//!
//! Without npm (or when the UI build fails) the Rust build still succeeds: it embeds a small
//! page that says how to build the UI, and prints a cargo warning. `BULKHEAD_SKIP_WEB_BUILD=1`
//! skips npm and embeds whatever `web/dist` holds (or that page).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

/// What in `web/` the built UI depends on.
const SOURCES: &[&str] = &[
    "src",
    "index.html",
    "package.json",
    "package-lock.json",
    "vite.config.ts",
    "tsconfig.json",
];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let web = manifest.join("..").join("web");
    let dist = web.join("dist");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=BULKHEAD_SKIP_WEB_BUILD");
    for s in SOURCES {
        println!("cargo:rerun-if-changed={}", web.join(s).display());
    }

    let skip = std::env::var("BULKHEAD_SKIP_WEB_BUILD").is_ok_and(|v| !v.is_empty() && v != "0");
    let problem = if !web.join("package.json").is_file() {
        Some("web/package.json is missing".to_string())
    } else if skip {
        (!dist.join("index.html").is_file())
            .then(|| "BULKHEAD_SKIP_WEB_BUILD is set and web/dist is missing".to_string())
    } else if is_fresh(&web, &dist) {
        None
    } else {
        build_ui(&web).err()
    };
    if let Some(p) = &problem {
        println!("cargo:warning=admin UI: {p}");
        if !dist.join("index.html").is_file() {
            // Once npm or the sources appear, the next build tries again.
            println!("cargo:rerun-if-changed={}", web.display());
        }
    }

    let root = if dist.join("index.html").is_file() {
        dist
    } else {
        let fallback = out.join("web-fallback");
        std::fs::create_dir_all(&fallback).expect("create fallback dir");
        let why = problem.unwrap_or_else(|| "web/dist is missing".into());
        std::fs::write(fallback.join("index.html"), fallback_page(&why))
            .expect("write fallback page");
        fallback
    };

    let mut files = Vec::new();
    collect(&root, &root, &mut files);
    let embed = out.join("web-embed");
    if embed.exists() {
        std::fs::remove_dir_all(&embed).expect("clear the embed dir");
    }
    files.sort();
    let mut code = String::from("&[\n");
    for (rel, abs) in &files {
        // Copied into OUT_DIR so that deleting or rebuilding web/dist never breaks a build
        // that did not rerun this script.
        let copy = embed.join(rel);
        std::fs::create_dir_all(copy.parent().expect("has a parent")).expect("create embed dir");
        std::fs::copy(abs, &copy).expect("copy UI file");
        writeln!(
            code,
            "    Asset {{ path: {rel:?}, bytes: include_bytes!({:?}) }},",
            copy.display().to_string()
        )
        .expect("write to string");
    }
    code.push(']');
    std::fs::write(out.join("web_assets.rs"), code).expect("write web_assets.rs");
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The newest modification time under `p` (a file or a directory tree).
fn newest(p: &Path) -> Option<SystemTime> {
    let meta = std::fs::metadata(p).ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    let mut best = meta.modified().ok();
    for e in std::fs::read_dir(p).ok()?.flatten() {
        best = best.max(newest(&e.path()));
    }
    best
}

/// `web/dist` exists and is newer than every source.
fn is_fresh(web: &Path, dist: &Path) -> bool {
    let Some(built) = mtime(&dist.join("index.html")) else {
        return false;
    };
    SOURCES
        .iter()
        .filter_map(|s| newest(&web.join(s)))
        .all(|t| t <= built)
}

fn run(web: &Path, args: &[&str]) -> Result<(), String> {
    let npm = if cfg!(windows) { "npm.cmd" } else { "npm" };
    let output = Command::new(npm)
        .args(args)
        .current_dir(web)
        .env("npm_config_update_notifier", "false")
        .output()
        .map_err(|e| {
            format!("npm is not available ({e}); install Node.js 20+ and npm to build it")
        })?;
    if output.status.success() {
        return Ok(());
    }
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let tail: Vec<&str> = text.lines().rev().take(15).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Err(format!(
        "`npm {}` failed ({}):\n{}",
        args.join(" "),
        output.status,
        tail.join("\n")
    ))
}

/// `npm ci` when the installed packages are missing or older than the lock file, then
/// `npm run build` (Vite) into `web/dist`.
fn build_ui(web: &Path) -> Result<(), String> {
    let installed = mtime(&web.join("node_modules").join(".package-lock.json"));
    let locked = mtime(&web.join("package-lock.json"));
    if installed.is_none() || installed < locked {
        run(
            web,
            &[
                "ci",
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                "--prefer-offline",
            ],
        )?;
    }
    run(web, &["run", "--silent", "build"])
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect(root, &p, out);
        } else if let Ok(rel) = p.strip_prefix(root) {
            let rel = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push((rel, p));
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn fallback_page(why: &str) -> String {
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Bulkhead admin UI not built</title>
<style>body{{font:16px/1.5 system-ui,sans-serif;max-width:44rem;margin:3rem auto;padding:0 1rem;color:#111}}
pre{{background:#f3f3f3;padding:.75rem;overflow:auto}}</style></head>
<body><main><h1>The admin UI was not built into this binary</h1>
<p>The <code>bulkhead</code> binary embeds the admin UI from <code>web/dist</code> when it is
compiled, building it with npm first. This build could not:</p>
<pre>{}</pre>
<p>Install Node.js 20 or newer with npm, then rebuild (touching a UI source makes the
build try again):</p>
<pre>touch web/package.json
cargo run --bin bulkhead -- serve</pre>
<p>The admin API is available at <code>/admin/v1/</code> all the same.</p></main></body></html>
"#,
        escape(why)
    )
}
