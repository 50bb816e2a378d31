//! With the `cuda` feature: compiles each kernels/*.cu into a fatbin with nvcc (-fmad=false, see
//! kernels/reducers.cu): machine code (SASS) for every architecture of `SASS_ARCHS`, plus the PTX of the
//! oldest, which the driver compiles for any newer GPU. The driver loads the SASS that matches its GPU,
//! so the kernels load on any driver of the toolkit's major version (a driver JIT-compiles only PTX of
//! an ISA no newer than its own; scripts/gpu-bundle.sh builds with the CUDA 13.0 toolkit so that the PTX
//! is ISA 9.0). The default build compiles nothing.

use std::path::PathBuf;
use std::process::Command;

/// A100 (and every 8.x GPU, which runs sm_80 code) and H100/H200.
const SASS_ARCHS: [&str; 2] = ["80", "90"];

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("the kernels/ directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    let mut gencode: Vec<String> = SASS_ARCHS
        .iter()
        .map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}"))
        .collect();
    let ptx = SASS_ARCHS[0];
    gencode.push(format!("-gencode=arch=compute_{ptx},code=compute_{ptx}"));
    for src in sources {
        let fatbin = out.join(
            src.with_extension("fatbin")
                .file_name()
                .expect("a file name"),
        );
        let status = Command::new(&nvcc)
            .args(["-fatbin", "-fmad=false"])
            .args(&gencode)
            .arg("-o")
            .arg(&fatbin)
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
