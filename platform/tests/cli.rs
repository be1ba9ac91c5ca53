//! The `bulkhead` command as an operator runs it: exit codes and messages.

use std::process::Command;

fn bulkhead() -> Command {
    Command::new(env!("CARGO_BIN_EXE_bulkhead"))
}

fn write_config(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("bulkhead-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("node.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn check_refuses_the_incident_deployment_with_its_numbers() {
    // The 2026 incident: a 1,048,576-token window on a 681,280-token pool.
    let cfg = write_config(
        "incident",
        r#"
pool_tokens = 681280
[[text_models]]
name = "@cf/example/one-million"
context_window = 1048576
"#,
    );
    let out = bulkhead()
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("681280") && err.contains("1048576") && err.contains("2097152"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn check_passes_a_deployment_that_fits() {
    let cfg = write_config(
        "fits",
        r#"
pool_tokens = 16384
[[text_models]]
name = "@cf/huggingfacetb/smollm2-135m-instruct"
"#,
    );
    let out = bulkhead()
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok"));
}

#[test]
fn check_rejects_an_unknown_setting_instead_of_ignoring_it() {
    let cfg = write_config("typo", "pool_tokenz = 5\n");
    let out = bulkhead()
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("pool_tokenz"));
}

#[test]
fn models_fetch_without_pip_fails_with_a_clear_message() {
    let empty = std::env::temp_dir().join(format!("bulkhead-nopath-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = bulkhead()
        .args(["models", "fetch"])
        .env("PATH", &empty)
        .env("BULKHEAD_MODELS", empty.join("cache"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot run pip") && err.contains("bulkhead models fetch"),
        "{err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("stack backtrace"),
        "{err}"
    );
}

#[test]
fn models_fetch_is_idempotent() {
    // The first run may download; the second must find everything in place.
    let first = bulkhead().args(["models", "fetch"]).output().unwrap();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = bulkhead().args(["models", "fetch"]).output().unwrap();
    assert!(second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    let bundled = bulkhead_runtime::models::fetch::BUNDLED.len();
    assert_eq!(err.matches("already in").count(), bundled, "{err}");
    assert!(!err.contains("downloading"), "{err}");
}

#[test]
fn a_node_with_a_too_small_pool_refuses_to_start() {
    let out = bulkhead()
        .args(["node", "--listen", "127.0.0.1:0", "--pool-tokens", "4096"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to start") && err.contains("16384"),
        "{err}"
    );
}

#[test]
fn devices_reports_kernels_and_gpus_as_json() {
    let out = bulkhead().arg("devices").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kernels = report["matmul_kernels"].as_str().unwrap();
    assert!(
        ["AMX", "AVX-512", "AVX2", "scalar"].contains(&kernels),
        "{report}"
    );
    // The default build runs models on the CPU whatever GPUs exist; each GPU listed has
    // no more free memory than it has.
    assert_eq!(report["models_device"], "cpu", "{report}");
    for g in report["gpus"].as_array().unwrap() {
        assert!(g["free_bytes"].as_u64().unwrap() <= g["total_bytes"].as_u64().unwrap());
        assert!(!g["name"].as_str().unwrap().is_empty(), "{g}");
    }
}
