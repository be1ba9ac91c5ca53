//! Sets `cfg(amx_kernels)` when the build targets x86-64 with the AVX-512 subsets the AMX
//! matmul kernels' epilogue uses (every CPU with AMX has them); whether the CPU running the
//! binary has AMX is asked at run time (`kernels::amx::enabled`). One place for the
//! predicate instead of a six-line `cfg(all(...))` at each use.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(amx_kernels)");
    println!("cargo::rerun-if-changed=build.rs");
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    let x86_64 = std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    if x86_64
        && ["avx512f", "avx512bw", "avx512dq", "f16c", "fma"]
            .into_iter()
            .all(has)
    {
        println!("cargo::rustc-cfg=amx_kernels");
    }
}
