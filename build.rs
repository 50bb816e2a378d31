//! With the `cuda` feature: compiles kernels/*.cu to PTX for $CUDA_COMPUTE_CAP (default 80) with nvcc
//! (-fmad=false, see kernels/reducers.cu). The default build compiles nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("the kernels/ directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    for src in sources {
        let ptx = out.join(src.with_extension("ptx").file_name().expect("a file name"));
        let status = Command::new(&nvcc)
            .args(["-ptx", "-fmad=false", &format!("-arch=sm_{cap}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("nvcc failed on {} ({s})", src.display()),
            Err(e) => panic!(
                "the cuda feature needs nvcc on PATH (or NVCC=...): {e}; without a CUDA toolkit, \
                 `source scripts/cuda/env.sh` installs nvcc from PyPI"
            ),
        }
    }
}
