//! The CUDA kernels run on the host (`kernels/emulate.hpp`: a block as `BLOCK` threads of this machine,
//! `__syncthreads` a barrier among them), so that the tests check each kernel against its CPU twin bit
//! for bit without a GPU: the kernel's own source, launched with the grid its launcher in `crate::cuda`
//! uses. Built once per test binary by the C++ compiler with contraction off (nvcc's `-fmad=false`).
//! Skipped without a C++ compiler unless `NANODIST_REQUIRE_CXX` is set (scripts/test.sh sets it).

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A kernel file of kernels/.
#[derive(Debug, Clone, Copy)]
pub enum Source {
    Reducers,
    Optim,
    Model,
}

impl Source {
    /// The file's kernels, and the test kernels of its device functions.
    fn text(self) -> String {
        match self {
            Source::Reducers => {
                [include_str!("../../kernels/reducers.cu"), DEVICE_FUNCTIONS].concat()
            }
            Source::Optim => include_str!("../../kernels/optim.cu").into(),
            Source::Model => include_str!("../../kernels/model.cu").into(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Source::Reducers => "reducers",
            Source::Optim => "optim",
            Source::Model => "model",
        }
    }
}

/// Kernels for the tests only, after reducers.cu: its device functions that the tests call alone.
const DEVICE_FUNCTIONS: &str = r#"
extern "C" __global__ void test_dct2(float* p, float* q, unsigned r, unsigned c, const float* da,
                                     const float* db, unsigned inverse) {
    dct2(p, q, r, c, da, db, inverse != 0);
}
extern "C" __global__ void test_kept_inverse(float* p, float* q, unsigned r, unsigned c, const float* da,
                                             const float* db, const float* idx, const float* val,
                                             unsigned k) {
    kept_inverse(p, q, r, c, da, db, idx, val, k);
}
extern "C" __global__ void test_sparse_inverse(float* p, float* q, unsigned r, unsigned c, const float* da,
                                               const float* db) {
    sparse_inverse(p, q, r, c, da, db);
}
"#;

/// One argument of a launch, in the kernel's order: a buffer (updated in place by `launch`) or a scalar.
#[derive(Debug, Clone)]
pub enum Arg {
    F32s(Vec<f32>),
    U32s(Vec<u32>),
    F64s(Vec<f64>),
    U32(u32),
    U64(u64),
    F32(f32),
}

impl Arg {
    fn bytes(&self) -> Option<Vec<u8>> {
        match self {
            Arg::F32s(v) => Some(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Arg::U32s(v) => Some(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Arg::F64s(v) => Some(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            _ => None,
        }
    }

    /// The buffer's length in bytes (None: a scalar).
    fn byte_len(&self) -> Option<usize> {
        match self {
            Arg::F32s(v) => Some(4 * v.len()),
            Arg::U32s(v) => Some(4 * v.len()),
            Arg::F64s(v) => Some(8 * v.len()),
            _ => None,
        }
    }

    fn scalar(&self) -> u64 {
        match *self {
            Arg::U32(v) => v as u64,
            Arg::U64(v) => v,
            Arg::F32(v) => v.to_bits() as u64,
            _ => unreachable!("a buffer"),
        }
    }

    /// The buffer's new contents from `bytes` (as many as it had).
    fn read_back(&mut self, bytes: &[u8]) {
        match self {
            Arg::F32s(v) => v.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(x, b)| {
                *x = f32::from_le_bytes(b.try_into().unwrap());
            }),
            Arg::U32s(v) => v.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(x, b)| {
                *x = u32::from_le_bytes(b.try_into().unwrap());
            }),
            Arg::F64s(v) => v.iter_mut().zip(bytes.chunks_exact(8)).for_each(|(x, b)| {
                *x = f64::from_le_bytes(b.try_into().unwrap());
            }),
            _ => {}
        }
    }

    pub fn f32s(&self) -> &[f32] {
        match self {
            Arg::F32s(v) => v,
            other => panic!("not an f32 buffer: {other:?}"),
        }
    }

    pub fn u32s(&self) -> &[u32] {
        match self {
            Arg::U32s(v) => v,
            other => panic!("not a u32 buffer: {other:?}"),
        }
    }

    pub fn f64s(&self) -> &[f64] {
        match self {
            Arg::F64s(v) => v,
            other => panic!("not an f64 buffer: {other:?}"),
        }
    }
}

/// The kernels a file's text defines: each one's name and number of parameters.
fn kernels_of(text: &str) -> Vec<(&str, usize)> {
    text.split("extern \"C\" __global__ void ")
        .skip(1)
        .map(|s| {
            let (name, rest) = s.split_once('(').expect("a kernel's parameters");
            (
                name,
                rest[..rest.find(')').expect("their end")]
                    .split(',')
                    .count(),
            )
        })
        .collect()
}

/// The grid of a grid-stride kernel over `n` elements, as `crate::cuda` launches it.
pub fn per_element(n: usize) -> (u32, u32) {
    (super::per_element_blocks(n) as u32, 1)
}

/// The host build of one kernel file.
pub struct Emulator {
    exe: PathBuf,
    dir: PathBuf,
}

/// How long one launch may take before the test calls it hung.
const LIMIT: Duration = Duration::from_secs(120);

impl Emulator {
    /// The host build of `source`, made once per test binary; None (the test skipped) when no C++
    /// compiler is found and none is required.
    pub fn get(source: Source) -> Option<&'static Emulator> {
        static BUILT: [OnceLock<Option<Emulator>>; 3] =
            [OnceLock::new(), OnceLock::new(), OnceLock::new()];
        BUILT[source as usize]
            .get_or_init(|| build(source))
            .as_ref()
    }

    /// Runs `kernel` over a grid of `grid` blocks with `args` (its parameters in order); each buffer
    /// argument then holds what the kernel left in it.
    pub fn launch(&self, kernel: &str, grid: (u32, u32), args: &mut [Arg]) {
        // Tests launch at once from several threads: each launch has files of its own.
        static LAUNCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let tag = format!(
            "{kernel}-{}",
            LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let (input, output) = (
            self.dir.join(format!("{tag}.in")),
            self.dir.join(format!("{tag}.out")),
        );
        let mut bytes = Vec::new();
        let head = [kernel.len() as u32, grid.0, grid.1, args.len() as u32];
        head.iter().for_each(|h| bytes.extend(h.to_le_bytes()));
        bytes.extend(kernel.as_bytes());
        for a in args.iter() {
            match a.bytes() {
                Some(b) => {
                    bytes.push(b'b');
                    bytes.extend((b.len() as u64).to_le_bytes());
                    bytes.extend(b);
                }
                None => {
                    bytes.push(b's');
                    bytes.extend(a.scalar().to_le_bytes());
                }
            }
        }
        std::fs::File::create(&input)
            .and_then(|mut f| f.write_all(&bytes))
            .unwrap();
        let mut child = Command::new(&self.exe)
            .args([&input, &output])
            .spawn()
            .unwrap();
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > LIMIT {
                let _ = child.kill();
                panic!(
                    "kernel {kernel} hung (a __syncthreads not every thread of a block reaches?)"
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(
            status.success(),
            "the host build of {kernel} failed ({status})"
        );
        let out = std::fs::read(&output).unwrap();
        let mut at = 0;
        for a in args.iter_mut() {
            if let Some(len) = a.byte_len() {
                a.read_back(&out[at..at + len]);
                at += len;
            }
        }
        assert_eq!(
            at,
            out.len(),
            "{kernel}: the buffers came back in another size"
        );
        let _ = (std::fs::remove_file(input), std::fs::remove_file(output));
    }
}

/// Builds `src` into `exe` with `cxx`: with the sanitizers first (an access past a buffer, an integer
/// conversion of a float out of range), without them where the compiler lacks their runtime or the
/// sanitized build does not start here. False when there is no such compiler.
fn compile(cxx: &str, src: &std::path::Path, exe: &std::path::Path, source: Source) -> bool {
    let sanitize = [
        "-fsanitize=address,undefined,float-cast-overflow",
        "-fno-sanitize-recover=all",
    ];
    let base = ["-O1", "-g", "-ffp-contract=off", "-std=c++20", "-pthread"];
    for flags in [&sanitize[..], &[]] {
        let out = Command::new(cxx)
            .args(base)
            .args(flags)
            .arg("-o")
            .arg(exe)
            .arg(src)
            .output();
        match out {
            Err(_) => return false, // no such compiler
            Ok(o) if o.status.success() && starts(exe) => return true,
            Ok(o) if !flags.is_empty() => {
                let why = if o.status.success() {
                    "does not start here"
                } else {
                    "does not build"
                };
                eprintln!(
                    "{cxx}: the sanitized build {why}; the kernels run on the host without them"
                );
            }
            Ok(o) => panic!(
                "{cxx} could not build the kernels of {} into a launcher that starts ({}):\n{}",
                source.name(),
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ),
        }
    }
    unreachable!("the build without sanitizers returns or panics")
}

/// Whether the built launcher starts here (a sanitizer's runtime may not, in some sandboxes): without
/// arguments it says so and exits with 3.
fn starts(exe: &std::path::Path) -> bool {
    let out = Command::new(exe).output();
    out.is_ok_and(|o| o.status.code() == Some(3))
}

/// The build folders' names in the temporary folder: this prefix, the file's name and the test
/// process's id.
const PREFIX: &str = "nanodist-emulate-";

/// Removes the build folders of test processes that have ended (a test binary exits without dropping
/// its statics, so each leaves its folder behind).
fn remove_stale() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.rsplit('-').next()?.parse::<u32>().ok());
        if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Compiles the emulation of `source` (its kernels, `KERNEL(name)` each, in the launcher).
fn build(source: Source) -> Option<Emulator> {
    remove_stale();
    let dir =
        std::env::temp_dir().join(format!("{PREFIX}{}-{}", source.name(), std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = source.text();
    let harness = include_str!("../../kernels/emulate.hpp");
    let list: String = kernels_of(&text)
        .iter()
        .map(|(k, _)| format!("KERNEL({k}) "))
        .collect();
    let cpp = format!(
        "{harness}\n{text}\n#define EMULATE_MAIN\n#define EMULATE_KERNELS {list}\n{harness}\n"
    );
    let (src, exe) = (dir.join("emulate.cpp"), dir.join("emulate"));
    std::fs::write(&src, cpp).unwrap();
    for cxx in [
        std::env::var("CXX").unwrap_or_default(),
        "c++".into(),
        "clang++".into(),
    ] {
        if compile(&cxx, &src, &exe, source) {
            return Some(Emulator { exe, dir });
        }
    }
    let required = std::env::var_os("NANODIST_REQUIRE_CXX").is_some_and(|v| v != "0");
    assert!(
        !required,
        "no C++ compiler (c++, clang++ or $CXX), and NANODIST_REQUIRE_CXX is set"
    );
    eprintln!("skipped: no C++ compiler (c++, clang++ or $CXX) to run the kernels on the host");
    None
}

mod tests {
    use super::*;
    use crate::kernels;
    use rand::{Rng, SeedableRng};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Values with ties, zeros of both signs and a few large ones: what a selection must order exactly.
    fn awkward(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|i| match i % 7 {
                0 => 0.25 * (rng.random_range(0..8) as f32) - 1.0,
                1 => {
                    if rng.random() {
                        0.0
                    } else {
                        -0.0
                    }
                }
                2 => rng.random_range(-1e3f32..1e3),
                _ => rng.random_range(-1.0f32..1.0),
            })
            .collect()
    }

    /// `crate::cuda`'s top_k: the radix select of the threshold with the `radix_histogram` kernel, the
    /// tiles' counts (`select_count`) scanned on the host, then `select_write`.
    fn top_k_emulated(e: &Emulator, x: &[f32], k: usize, base: u32) -> (Vec<u32>, Vec<f32>) {
        let n = x.len();
        let t = kernels::radix_threshold(k, |prefix, mask, shift| {
            let mut args = [
                Arg::F32s(x.to_vec()),
                Arg::U32(n as u32),
                Arg::U32(prefix),
                Arg::U32(mask),
                Arg::U32(shift),
                Arg::U32s(vec![0; kernels::BLOCK]),
            ];
            e.launch("radix_histogram", per_element(n), &mut args);
            Ok(args[5].u32s().try_into().unwrap())
        })
        .unwrap();
        let tiles = n.div_ceil(kernels::TILE);
        let mut args = [
            Arg::F32s(x.to_vec()),
            Arg::U32(n as u32),
            Arg::U32(t.key),
            Arg::U32s(vec![0; tiles]),
            Arg::U32s(vec![0; tiles]),
        ];
        e.launch("select_count", (tiles as u32, 1), &mut args);
        let (above, equal) = (args[3].u32s(), args[4].u32s());
        let mut args = [
            Arg::F32s(x.to_vec()),
            Arg::U32(n as u32),
            Arg::U32(t.key),
            Arg::U32(t.ties),
            Arg::U32s(kernels::exclusive_scan(above)),
            Arg::U32s(kernels::exclusive_scan(equal)),
            Arg::U32(base),
            Arg::U32s(vec![0; k]),
            Arg::F32s(vec![0.0; k]),
        ];
        e.launch("select_write", (tiles as u32, 1), &mut args);
        (args[7].u32s().to_vec(), args[8].f32s().to_vec())
    }

    /// The selection kernels pick the twin's entries in the twin's order: ties towards lower indices,
    /// across tiles, with a NaN and infinities, with every key equal, and k the whole input.
    #[test]
    fn the_selection_kernels_are_top_k() {
        let Some(e) = Emulator::get(Source::Reducers) else {
            return;
        };
        let mut long = awkward(2 * kernels::TILE + 333, 1);
        // A NaN's key is above infinity's, as on the GPU.
        (long[5], long[4100], long[7000]) = (f32::NAN, f32::INFINITY, f32::NEG_INFINITY);
        let cases: [(Vec<f32>, &[usize]); 3] = [
            (long, &[1, 100, 3000, 2 * kernels::TILE + 333]),
            (vec![0.5; 5000], &[1, 4097]),
            (awkward(77, 2), &[7, 77]),
        ];
        for (x, ks) in cases {
            for &k in ks {
                let (mut idx, mut val) = (Vec::new(), Vec::new());
                kernels::top_k(&x, k, 10, &mut idx, &mut val);
                let (di, dv) = top_k_emulated(e, &x, k, 10);
                assert_eq!((di, bits(&dv)), (idx, bits(&val)), "n {}, k {k}", x.len());
            }
        }
    }

    /// Gram-Schmidt per matrix (one block each) is the twin's, bit for bit, with a zero column, more
    /// rows than a block has threads, and several matrices side by side.
    #[test]
    fn gram_schmidt_is_its_twin() {
        let Some(e) = Emulator::get(Source::Reducers) else {
            return;
        };
        for (rows, cols, matrices) in [(600, 4, 2), (5, 3, 3), (64, 1, 1)] {
            let mut p = awkward(rows * cols * matrices, 3);
            (0..rows).for_each(|r| p[r * cols] = 0.0);
            let mut args = [
                Arg::F32s(p.clone()),
                Arg::U32(rows as u32),
                Arg::U32(cols as u32),
                Arg::F32(1e-8),
            ];
            e.launch("gram_schmidt", (matrices as u32, 1), &mut args);
            kernels::gram_schmidt(&mut p, rows, cols, 1e-8);
            assert_eq!(
                bits(args[0].f32s()),
                bits(&p),
                "{rows} x {cols} x {matrices}"
            );
        }
    }

    /// The elementwise and index-list kernels against their twins, on one input each.
    #[test]
    fn the_elementwise_kernels_are_their_twins() {
        let Some(e) = Emulator::get(Source::Reducers) else {
            return;
        };
        let n = 3000;
        let (x, y) = (awkward(n, 4), awkward(n, 5));
        let idx: Vec<u32> = (0..n as u32).filter(|i| i % 3 == 1).collect();
        let vals = awkward(idx.len(), 6);
        let k = idx.len() as u32;
        let grid = per_element(n);
        // The index-list kernels are not grid-stride: a thread per index (`per_index!`).
        let one_per_index = (idx.len().div_ceil(kernels::BLOCK) as u32, 1);
        let mut want = x.clone();
        let dense = |v: &[f32]| Arg::F32s(v.to_vec());
        let mut args = [dense(&x), dense(&y), Arg::U32(n as u32), Arg::F32(0.375)];
        e.launch("mix", grid, &mut args);
        kernels::mix(&mut want, &y, 0.375);
        assert_eq!(bits(args[0].f32s()), bits(&want), "mix");
        let mut args = [dense(&x), Arg::U32(n as u32), Arg::F32(-0.3)];
        e.launch("scale", grid, &mut args);
        want.copy_from_slice(&x);
        kernels::scale(&mut want, -0.3);
        assert_eq!(bits(args[0].f32s()), bits(&want), "scale");
        let hat: Vec<f32> = y.iter().rev().copied().collect();
        let mut args = [
            dense(&x),
            dense(&y),
            dense(&hat),
            Arg::U32(n as u32),
            Arg::F32(0.9),
        ];
        e.launch("choco_step", grid, &mut args);
        want.copy_from_slice(&x);
        kernels::choco_step(&mut want, &y, &hat, 0.9);
        assert_eq!(bits(args[0].f32s()), bits(&want), "choco_step");
        let list = |name: &str, dense_in: &[f32]| {
            let mut args = [
                dense(dense_in),
                Arg::U32s(idx.clone()),
                dense(&vals),
                Arg::U32(k),
            ];
            e.launch(name, one_per_index, &mut args);
            (args[0].f32s().to_vec(), args[2].f32s().to_vec())
        };
        let (mut acc, mut out) = (x.clone(), vals.clone());
        kernels::gather_clear(&mut acc, &idx, &mut out);
        let (dacc, dout) = list("gather_clear", &x);
        assert_eq!(
            (bits(&dacc), bits(&dout)),
            (bits(&acc), bits(&out)),
            "gather_clear"
        );
        kernels::gather(&x, &idx, &mut out);
        assert_eq!(bits(&list("gather", &x).1), bits(&out), "gather");
        let mut d = x.clone();
        kernels::scatter_add(&mut d, &idx, &vals);
        assert_eq!(bits(&list("scatter_add", &x).0), bits(&d), "scatter_add");
        d.copy_from_slice(&x);
        kernels::scatter(&mut d, &idx, &vals);
        assert_eq!(bits(&list("scatter", &x).0), bits(&d), "scatter");
        for own in [true, false] {
            let (mut h, mut m) = (x.clone(), y.clone());
            kernels::choco_absorb(own.then_some(&mut h[..]), &mut m, &idx, &vals, 1, 0.25);
            let mut args = [
                dense(&x),
                dense(&y),
                Arg::U32s(idx.clone()),
                dense(&vals),
                Arg::U32(k),
                Arg::U32(1),
                Arg::F32(0.25),
                Arg::U32(own.into()),
            ];
            e.launch("choco_absorb", one_per_index, &mut args);
            let got = (bits(args[0].f32s()), bits(args[1].f32s()));
            assert_eq!(got, (bits(&h), bits(&m)), "choco_absorb, own {own}");
        }
    }

    /// The arguments of a macro call's body (the text after its opening parenthesis), split at its
    /// top-level commas.
    fn call_args(body: &str) -> Vec<String> {
        let (mut depth, mut args, mut cur) = (0, Vec::new(), String::new());
        for ch in body.chars() {
            match ch {
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' if depth == 0 => break,
                ')' | ']' | '}' => depth -= 1,
                ',' if depth == 0 => {
                    args.push(std::mem::take(&mut cur).trim().to_string());
                    continue;
                }
                _ => {}
            }
            cur.push(ch);
        }
        args.push(cur.trim().to_string());
        args.retain(|a| !a.is_empty());
        args
    }

    /// Every launch in `crate::cuda` names a kernel of the .cu files and passes as many arguments as
    /// it takes (a missing or extra one would shift every later argument on the GPU, where nothing
    /// checks them), and every kernel is launched.
    #[test]
    fn every_launch_passes_its_kernels_parameters() {
        let texts = [
            Source::Reducers.text(),
            Source::Optim.text(),
            Source::Model.text(),
        ];
        let kernels: std::collections::HashMap<&str, usize> =
            texts.iter().flat_map(|t| kernels_of(t)).collect();
        let launchers = [
            include_str!("../cuda/mod.rs"),
            include_str!("../cuda/optim.rs"),
            include_str!("../cuda/model.rs"),
        ]
        .concat();
        let mut launched = std::collections::HashSet::new();
        for (call, fixed) in [("launch!(", 3), ("per_index!(", 2)] {
            for body in launchers.split(call).skip(1) {
                let args = call_args(body);
                let Some(name) = args.get(1).and_then(|a| a.strip_prefix('"')) else {
                    continue; // the macros' own definitions
                };
                let name = name.trim_end_matches('"');
                let params = kernels
                    .get(name)
                    .unwrap_or_else(|| panic!("no kernel {name}"));
                // per_index! passes the dense buffer, the indices, the values and their count.
                let passed = args.len() - fixed + usize::from(call == "per_index!(");
                assert_eq!(passed, *params, "{name}: {args:?}");
                launched.insert(name.to_string());
            }
        }
        let unused: Vec<_> = kernels.keys().filter(|k| !launched.contains(**k)).collect();
        let tests_only = |k: &&&str| k.starts_with("test_");
        assert!(
            unused.iter().all(tests_only),
            "kernels never launched: {unused:?}"
        );
    }

    /// The emulation itself on `sum_squares`: a block's tree sum sees every thread's part (the barriers
    /// hold), and the tiles' f64 sums, added in order as the launcher adds them, are the twin's bits.
    #[test]
    fn kernels_run_on_the_host() {
        let Some(e) = Emulator::get(Source::Optim) else {
            return;
        };
        let n = 3 * super::super::TILE + 17;
        let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        let tiles = n.div_ceil(super::super::TILE);
        let mut args = [
            Arg::F32s(x.clone()),
            Arg::U32(n as u32),
            Arg::F64s(vec![0.0; tiles]),
        ];
        e.launch("sum_squares", (tiles as u32, 1), &mut args);
        let exact: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let got = args[2].f64s().iter().fold(0.0, |a, b| a + b);
        assert_eq!(got, exact, "small integers' squares add exactly");
        let x: Vec<f32> = awkward(n, 9);
        let mut args = [
            Arg::F32s(x.clone()),
            Arg::U32(n as u32),
            Arg::F64s(vec![0.0; tiles]),
        ];
        e.launch("sum_squares", (tiles as u32, 1), &mut args);
        let got = args[2].f64s().iter().fold(0.0, |a, b| a + b);
        assert_eq!(got.to_bits(), kernels::optim::sum_squares(&x).to_bits());
    }
}
