//! Launchers of the CUDA kernels (kernels/*.cu, compiled to fatbins by build.rs): the reducers' here, the
//! optimizers' in `optim`, the model's in `model`. Each one runs its kernel with the grid its CPU
//! twin in `crate::kernels` mirrors, and shares the twin's host-side steps (the radix digit search, the
//! scan of tile counts, the sum over tiles); `tests/gpu.rs` (run by the GPU self-test,
//! scripts/gpu/selftest.py) compares every launcher with its twin on a GPU.

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::kernels::{self, Threshold, BLOCK, TILE};

/// The fatbin of every kernel file: SASS for sm_80 and sm_90 and PTX for newer GPUs (see build.rs).
const FATBINS: [&[u8]; 3] = [
    include_bytes!(concat!(env!("OUT_DIR"), "/model.fatbin")),
    include_bytes!(concat!(env!("OUT_DIR"), "/reducers.fatbin")),
    include_bytes!(concat!(env!("OUT_DIR"), "/optim.fatbin")),
];

fn grid(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.clamp(1, u32::MAX as usize) as u32, 1, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_element(n: usize) -> LaunchConfig {
    grid(kernels::per_element_blocks(n))
}

/// A message of `len` entries at `off` lies inside a channel's public copy and memory.
fn in_channel(off: usize, len: usize, hat: &CudaSlice<f32>, memory: &CudaSlice<f32>) -> Result<()> {
    let channel = hat.len().min(memory.len());
    ensure!(
        off + len <= channel,
        "internal error: a message of {len} entries at {off} past a channel of {channel}"
    );
    Ok(())
}

fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n)
        .with_context(|| format!("{what} = {n} does not fit the kernels' 32-bit indices"))
}

/// Launches kernel `$name` of `$k` (a `Kernels`) with `$cfg` and the arguments in order. The launch is an
/// unsafe operation (the driver checks neither the arguments' types nor the memory the kernel touches),
/// so every use sits in an `unsafe` block whose SAFETY comment says why the arguments are the kernel's
/// and why its grid stays inside the buffers.
macro_rules! launch {
    ($k:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let f = $k.f($name)?;
        let mut b = $k.stream.launch_builder(&f);
        $( b.arg($arg); )+
        b.launch($cfg)?;
    }};
}

/// Launches the index-list kernel `$name` (signature: dense, idx, values, k) over the idx.len() entries,
/// after checking that `$vals` holds one value per index. An unsafe operation, as `launch!`: the indices
/// are on the device, and the caller vouches that each is inside `$dense`.
macro_rules! per_index {
    ($k:expr, $name:expr, $dense:expr, $idx:expr, $vals:expr) => {{
        let k = u32_of($idx.len(), "index count")?;
        anyhow::ensure!(
            $vals.len() >= $idx.len(),
            "internal error: {} values for {} indices",
            $vals.len(),
            $idx.len()
        );
        launch!(
            $k,
            $name,
            grid($idx.len().div_ceil(BLOCK)),
            $dense,
            $idx,
            $vals,
            &k
        );
        Ok(())
    }};
}

mod model;
mod optim;
pub use optim::DeviceSegments;

pub struct Kernels {
    stream: Arc<CudaStream>,
    modules: Vec<Arc<CudaModule>>,
    /// The candle device whose stream this is (for candle's operations on the same buffers).
    candle: Option<candle_core::CudaDevice>,
}

impl Kernels {
    /// Loads the kernels into the context of `stream`; every launch goes to `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        // A heap copy: the driver reads the image at an 8-byte aligned address.
        let modules = FATBINS
            .iter()
            .map(|image| {
                stream
                    .context()
                    .load_module(Ptx::from_binary(image.to_vec()))
            })
            .collect::<Result<_, _>>()
            .context(
                "loading the kernels (SASS for sm_80/sm_90, PTX of CUDA 13.0 for other GPUs)",
            )?;
        Ok(Self {
            stream,
            modules,
            candle: None,
        })
    }

    /// The kernels on the stream of candle's device `dev`, which candle's operations also use.
    pub fn for_candle(dev: &candle_core::CudaDevice) -> Result<Self> {
        Ok(Self {
            candle: Some(dev.clone()),
            ..Self::new(dev.cuda_stream())?
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Candle's device of this stream (kernels made by `for_candle`).
    pub fn candle_device(&self) -> Result<&candle_core::CudaDevice> {
        self.candle
            .as_ref()
            .context("internal error: these kernels were made without a candle device")
    }

    fn f(&self, name: &str) -> Result<CudaFunction> {
        self.modules
            .iter()
            .find_map(|m| m.load_function(name).ok())
            .with_context(|| format!("no kernel {name} in the loaded fatbins"))
    }

    /// A candle tensor of `shape` on this stream's device, holding `buf`.
    pub fn tensor(
        &self,
        buf: CudaSlice<f32>,
        shape: impl Into<candle_core::Shape>,
    ) -> Result<candle_core::Tensor> {
        use candle_core::{op::BackpropOp, CudaStorage, Storage, Tensor};
        let dev = self.candle_device()?.clone();
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev));
        Ok(Tensor::from_storage(
            storage,
            shape,
            BackpropOp::none(),
            false,
        ))
    }

    /// The k entries of largest |x| in index order (indices base + i, and values), as `kernels::top_k`.
    pub fn top_k(
        &self,
        x: &CudaView<f32>,
        k: usize,
        base: u32,
    ) -> Result<(CudaSlice<u32>, CudaSlice<f32>)> {
        let (s, n) = (&self.stream, x.len());
        let k = k.min(n);
        let mut idx = s.alloc_zeros::<u32>(k.max(1))?;
        let mut val = s.alloc_zeros::<f32>(k.max(1))?;
        if k == 0 {
            return Ok((idx, val));
        }
        let n32 = u32_of(n, "tensor length")?;
        let mut hist = s.alloc_zeros::<u32>(BLOCK)?;
        let t: Threshold = kernels::radix_threshold(k, |prefix, mask, shift| {
            s.memset_zeros(&mut hist)?;
            // SAFETY: radix_histogram(x, n, prefix, mask, shift, hist) in reducers.cu: its grid-stride
            // loop reads x below n = x.len() and counts into hist's BLOCK bins.
            unsafe {
                launch!(
                    self,
                    "radix_histogram",
                    per_element(n),
                    x,
                    &n32,
                    &prefix,
                    &mask,
                    &shift,
                    &mut hist
                )
            };
            let h = s.clone_dtoh(&hist)?;
            Ok(h.try_into().expect("BLOCK counters"))
        })?;
        let tiles = n.div_ceil(TILE);
        let mut above = s.alloc_zeros::<u32>(tiles)?;
        let mut equal = s.alloc_zeros::<u32>(tiles)?;
        // SAFETY: select_count(x, n, thresh, above, equal): block t reads x's tile t (below n = x.len())
        // and writes above[t] and equal[t], both `tiles` long.
        unsafe {
            launch!(
                self,
                "select_count",
                grid(tiles),
                x,
                &n32,
                &t.key,
                &mut above,
                &mut equal
            )
        };
        let above_off = s.clone_htod(&kernels::exclusive_scan(&s.clone_dtoh(&above)?))?;
        let equal_off = s.clone_htod(&kernels::exclusive_scan(&s.clone_dtoh(&equal)?))?;
        // SAFETY: select_write(x, n, thresh, ties, above_off, equal_off, base, idx, val): block t reads x's
        // tile t and its two offsets (`tiles` each), and writes its entries at those offsets, which the
        // scans of the counts keep below k = idx.len() = val.len().
        unsafe {
            launch!(
                self,
                "select_write",
                grid(tiles),
                x,
                &n32,
                &t.key,
                &t.ties,
                &above_off,
                &equal_off,
                &base,
                &mut idx,
                &mut val,
            )
        };
        Ok((idx, val))
    }

    /// out[j] = x[idx[j]].
    ///
    /// # Safety
    /// The indices live on the device, where nothing checks them: every idx[j] is below x.len().
    pub unsafe fn gather(
        &self,
        x: &CudaSlice<f32>,
        idx: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        // SAFETY: gather(dense, idx, vals, k) in reducers.cu over k = idx.len() entries (vals checked to
        // hold as many); the caller's contract keeps every index inside the dense buffer.
        unsafe { per_index!(self, "gather", x, idx, out) }
    }

    /// out[j] = acc[idx[j]], then acc[idx[j]] = 0 (the error-feedback split).
    ///
    /// # Safety
    /// The indices live on the device, where nothing checks them: every idx[j] is below acc.len(), and the indices are distinct.
    pub unsafe fn gather_clear(
        &self,
        acc: &mut CudaSlice<f32>,
        idx: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        // SAFETY: gather_clear(dense, idx, vals, k) in reducers.cu over k = idx.len() entries (vals checked to
        // hold as many); the caller's contract keeps every index inside the dense buffer.
        unsafe { per_index!(self, "gather_clear", acc, idx, out) }
    }

    /// dense[idx[j]] = vals[j].
    ///
    /// # Safety
    /// The indices live on the device, where nothing checks them: every idx[j] is below dense.len(), and the indices are distinct.
    pub unsafe fn scatter(
        &self,
        dense: &mut CudaSlice<f32>,
        idx: &CudaSlice<u32>,
        vals: &CudaSlice<f32>,
    ) -> Result<()> {
        // SAFETY: scatter(dense, idx, vals, k) in reducers.cu over k = idx.len() entries (vals checked to
        // hold as many); the caller's contract keeps every index inside the dense buffer.
        unsafe { per_index!(self, "scatter", dense, idx, vals) }
    }

    /// dense[idx[j]] += vals[j] (distinct indices).
    ///
    /// # Safety
    /// The indices live on the device, where nothing checks them: every idx[j] is below dense.len(), and the indices are distinct.
    pub unsafe fn scatter_add(
        &self,
        dense: &mut CudaSlice<f32>,
        idx: &CudaView<u32>,
        vals: &CudaView<f32>,
    ) -> Result<()> {
        // SAFETY: scatter_add(dense, idx, vals, k) in reducers.cu over k = idx.len() entries (vals checked to
        // hold as many); the caller's contract keeps every index inside the dense buffer.
        unsafe { per_index!(self, "scatter_add", dense, idx, vals) }
    }

    /// acc += g.
    pub fn ef_accumulate(&self, acc: &mut CudaSlice<f32>, g: &CudaSlice<f32>) -> Result<()> {
        let n = u32_of(acc.len().min(g.len()), "length")?;
        // SAFETY: ef_accumulate(acc, g, n): its grid-stride loop stays below n, the shorter buffer's length.
        unsafe { launch!(self, "ef_accumulate", per_element(n as usize), acc, g, &n) };
        Ok(())
    }

    /// dst[at..at + src.len()] += src (the `ef_accumulate` kernel on a view).
    pub fn add_at(&self, dst: &mut CudaSlice<f32>, at: usize, src: &CudaView<f32>) -> Result<()> {
        let n = u32_of(src.len(), "length")?;
        let mut view = dst.slice_mut(at..at + src.len());
        // SAFETY: ef_accumulate(acc, g, n) over n = src.len() entries; the view (bounds-checked by
        // slice_mut) holds as many.
        unsafe {
            launch!(
                self,
                "ef_accumulate",
                per_element(src.len()),
                &mut view,
                src,
                &n
            )
        };
        Ok(())
    }

    /// x = own * x + b (gossip's mix).
    pub fn mix(&self, x: &mut CudaViewMut<f32>, b: &CudaView<f32>, own: f32) -> Result<()> {
        let n = u32_of(x.len().min(b.len()), "length")?;
        // SAFETY: mix(x, b, n, own): its grid-stride loop stays below n, the shorter buffer's length.
        unsafe { launch!(self, "mix", per_element(n as usize), x, b, &n, &own) };
        Ok(())
    }

    /// dst = src * s.
    pub fn scaled_copy(
        &self,
        dst: &mut CudaViewMut<f32>,
        src: &CudaView<f32>,
        s: f32,
    ) -> Result<()> {
        let n = u32_of(dst.len().min(src.len()), "length")?;
        // SAFETY: scaled_copy(dst, src, n, s): its grid-stride loop stays below n, the shorter length.
        unsafe {
            launch!(
                self,
                "scaled_copy",
                per_element(n as usize),
                dst,
                src,
                &n,
                &s
            )
        };
        Ok(())
    }

    /// x *= s.
    pub fn scale(&self, x: &mut CudaSlice<f32>, s: f32) -> Result<()> {
        let n = u32_of(x.len(), "length")?;
        // SAFETY: scale(x, n, s): its grid-stride loop stays below n = x.len().
        unsafe { launch!(self, "scale", per_element(n as usize), x, &n, &s) };
        Ok(())
    }

    /// DeMo's compression of every chunk of `delta` (the table's `CHUNK_FIELDS` words per chunk, as
    /// `sync::demo` lays them out): its top-k DCT coefficients into `msg`, the rest left in `delta`.
    /// `scratch` holds twice delta's length.
    ///
    /// # Safety
    /// The table, on the device, is `sync::demo`'s of a buffer of delta's length: its chunks lie inside
    /// delta (and, doubled, scratch), its message offsets inside msg, and dct holds each chunk size's
    /// transform.
    pub unsafe fn demo_encode(
        &self,
        delta: &mut CudaSlice<f32>,
        table: &CudaSlice<u32>,
        dct: &CudaSlice<f32>,
        scratch: &mut CudaSlice<f32>,
        msg: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let chunks = table.len() / kernels::CHUNK_FIELDS;
        let numel = u32_of(delta.len(), "length")?;
        // SAFETY: demo_encode(delta, chunks, dct, scratch, numel, msg), one block per table row; the
        // caller's contract keeps every row's chunk and message inside the buffers.
        unsafe {
            launch!(
                self,
                "demo_encode",
                grid(chunks),
                delta,
                table,
                dct,
                scratch,
                &numel,
                msg
            )
        };
        Ok(())
    }

    /// DeMo's decompression of every rank's messages in `all`: the sign of the averaged direction of
    /// every chunk into `grads`.
    ///
    /// # Safety
    /// As `demo_encode`'s, for `grads` (delta's length) and `all` (`ranks` messages of one layout).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn demo_decode(
        &self,
        all: &CudaSlice<f32>,
        ranks: usize,
        table: &CudaSlice<u32>,
        dct: &CudaSlice<f32>,
        scratch: &mut CudaSlice<f32>,
        grads: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let chunks = table.len() / kernels::CHUNK_FIELDS;
        let per_rank = u32_of(all.len() / ranks.max(1), "message length")?;
        let (ranks, numel) = (u32_of(ranks, "ranks")?, u32_of(grads.len(), "length")?);
        // SAFETY: demo_decode(all, per_rank, ranks, chunks, dct, scratch, numel, grads), one block per
        // table row; the caller's contract keeps every row inside the buffers.
        unsafe {
            launch!(
                self,
                "demo_decode",
                grid(chunks),
                all,
                &per_rank,
                &ranks,
                table,
                dct,
                scratch,
                &numel,
                grads
            )
        };
        Ok(())
    }

    /// One member's sparse CHOCO message into a channel: hat[off + idx[j]] += vals[j] when `own`, and
    /// memory[off + idx[j]] += w vals[j] (twin: `kernels::choco_absorb`).
    ///
    /// # Safety
    /// The indices live on the device, where nothing checks them: every off + idx[j] is below hat's and
    /// memory's lengths.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn choco_absorb(
        &self,
        hat: &mut CudaSlice<f32>,
        memory: &mut CudaSlice<f32>,
        idx: &CudaView<u32>,
        vals: &CudaView<f32>,
        off: usize,
        w: f32,
        own: bool,
    ) -> Result<()> {
        let (k, off, own) = (
            u32_of(idx.len(), "index count")?,
            u32_of(off, "offset")?,
            u32::from(own),
        );
        ensure!(
            vals.len() >= idx.len(),
            "internal error: fewer values than indices"
        );
        // SAFETY: choco_absorb(hat, memory, idx, vals, k, off, w, own) over k = idx.len() entries (vals
        // holds as many); the caller's contract keeps off + idx[j] inside hat and memory.
        unsafe {
            launch!(
                self,
                "choco_absorb",
                grid(idx.len().div_ceil(BLOCK)),
                hat,
                memory,
                idx,
                vals,
                &k,
                &off,
                &w,
                &own
            )
        };
        Ok(())
    }

    /// CHOCO's QSGD message of the tensor `u` into `norms` (one per bucket) and the zeroed `codes`
    /// (twin: `Codec::encode` on the host, with `kernels::chacha8_word`'s stream and
    /// `kernels::block_strided_sum`'s norms).
    ///
    /// # Safety
    /// `norms` holds one float per bucket of `bucket` entries of u, `codes` the bit-packed codes of all
    /// of u's entries at `bits` bits each (the layout `Codec::encode` writes), and `key` the ChaCha8 key.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn qsgd_encode(
        &self,
        u: &CudaView<f32>,
        bucket: usize,
        key: &CudaSlice<u32>,
        stream: u64,
        levels: u32,
        bits: u32,
        norms: &mut CudaViewMut<f32>,
        codes: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        let (len, bucket) = (u32_of(u.len(), "length")?, u32_of(bucket.max(1), "bucket")?);
        let blocks = norms.len();
        // SAFETY: qsgd_encode(u, len, bucket, key, stream, levels, bits, norms, codes), one block per
        // bucket (norms.len() of them); the caller's contract sizes norms, codes and key for u.
        unsafe {
            launch!(
                self,
                "qsgd_encode",
                grid(blocks),
                u,
                &len,
                &bucket,
                key,
                &stream,
                &levels,
                &bits,
                norms,
                codes
            )
        };
        Ok(())
    }

    /// One member's QSGD message of the tensor at `off` (its `len` entries) into a channel (twin:
    /// `Codec::decode` on the host, applied as `Channels::absorb` does).
    ///
    /// # Safety
    /// `norms` and `codes` are a message of `len` entries in buckets of `bucket` (as `qsgd_encode`
    /// writes one).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn qsgd_absorb(
        &self,
        hat: &mut CudaSlice<f32>,
        memory: &mut CudaSlice<f32>,
        (off, len, bucket): (usize, usize, usize),
        norms: &CudaView<f32>,
        codes: &CudaView<f32>,
        (levels, bits): (u32, u32),
        (tau, tau_last): (f32, f32),
        (w, own): (f32, bool),
    ) -> Result<()> {
        let (o, n, b) = (
            u32_of(off, "offset")?,
            u32_of(len, "length")?,
            u32_of(bucket.max(1), "bucket")?,
        );
        let own = u32::from(own);
        in_channel(off, len, hat, memory)?;
        // SAFETY: qsgd_absorb(hat, memory, off, len, bucket, norms, codes, levels, bits, tau, tau_last, w,
        // own) over len entries from off, inside hat and memory (checked above); the caller's contract
        // sizes norms and codes for them.
        unsafe {
            launch!(
                self,
                "qsgd_absorb",
                per_element(len),
                hat,
                memory,
                &o,
                &n,
                &b,
                norms,
                codes,
                &levels,
                &bits,
                &tau,
                &tau_last,
                &w,
                &own
            )
        };
        Ok(())
    }

    /// CHOCO's sign message of the tensor `u` into `out` (its scale, then the sign bits).
    ///
    /// # Safety
    /// `out` holds the message of u's length (the layout `Codec::encode` writes).
    pub unsafe fn sign_encode(&self, u: &CudaView<f32>, out: &mut CudaViewMut<f32>) -> Result<()> {
        let len = u32_of(u.len(), "length")?;
        // SAFETY: sign_encode(u, len, out), one block over u's len entries; the caller's contract sizes
        // out for them.
        unsafe { launch!(self, "sign_encode", grid(1), u, &len, out) };
        Ok(())
    }

    /// One member's sign message `part` of the tensor at `off` (`len` entries) into a channel.
    ///
    /// # Safety
    /// `part` is a sign message of `len` entries (as `sign_encode` writes one).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sign_absorb(
        &self,
        hat: &mut CudaSlice<f32>,
        memory: &mut CudaSlice<f32>,
        off: usize,
        len: usize,
        part: &CudaView<f32>,
        w: f32,
        own: bool,
    ) -> Result<()> {
        let (o, n, own) = (
            u32_of(off, "offset")?,
            u32_of(len, "length")?,
            u32::from(own),
        );
        in_channel(off, len, hat, memory)?;
        // SAFETY: sign_absorb(hat, memory, off, len, part, w, own) over len entries from off, inside hat
        // and memory (checked above); the caller's contract sizes part for them.
        unsafe {
            launch!(
                self,
                "sign_absorb",
                per_element(len),
                hat,
                memory,
                &o,
                &n,
                part,
                &w,
                &own
            )
        };
        Ok(())
    }

    /// DiLoCo's quantizer: each row of `table` (start in `buf`, length, first word; 3 words a row) of
    /// `buf` into its wire words in `out`, `mode` 1 bf16, 2 fp8, 3 uint8 (twin: `sync::quantize::encode`).
    ///
    /// # Safety
    /// The table, on the device, is `sync::quantize`'s for buffers of these lengths: every row lies inside
    /// buf and its words inside out.
    pub unsafe fn quantize_rows(
        &self,
        buf: &CudaView<f32>,
        table: &CudaSlice<u32>,
        mode: u32,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if table.len() < 3 {
            return Ok(());
        }
        // SAFETY: quantize_rows(buf, table, mode, out), one block per table row; the caller's contract
        // keeps each row inside buf and out.
        unsafe {
            launch!(
                self,
                "quantize_rows",
                grid(table.len() / 3),
                buf,
                table,
                &mode,
                out
            )
        };
        Ok(())
    }

    /// The rows of `table` back from their wire words (twin: `sync::quantize::decode`).
    ///
    /// # Safety
    /// As `quantize_rows`', with `words` in the place of out and `buf` of buf.
    pub unsafe fn dequantize_rows(
        &self,
        words: &CudaView<f32>,
        table: &CudaSlice<u32>,
        mode: u32,
        buf: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        if table.len() < 3 {
            return Ok(());
        }
        // SAFETY: dequantize_rows(words, table, mode, buf), one block per table row; the caller's
        // contract keeps each row inside words and buf.
        unsafe {
            launch!(
                self,
                "dequantize_rows",
                grid(table.len() / 3),
                words,
                table,
                &mode,
                buf
            )
        };
        Ok(())
    }

    /// CHOCO's consensus step x += gamma (s - hat) (twin: `kernels::choco_step`).
    pub fn choco_step(
        &self,
        x: &mut CudaSlice<f32>,
        s: &CudaSlice<f32>,
        hat: &CudaSlice<f32>,
        gamma: f32,
    ) -> Result<()> {
        let n = u32_of(x.len(), "length")?;
        ensure!(
            s.len() >= x.len() && hat.len() >= x.len(),
            "internal error: CHOCO's step over buffers of {}, {} and {} floats",
            x.len(),
            s.len(),
            hat.len()
        );
        // SAFETY: choco_step(x, s, hat, n, gamma): its grid-stride loop stays below n = x.len(), which s
        // and hat hold too (checked above).
        unsafe {
            launch!(
                self,
                "choco_step",
                per_element(n as usize),
                x,
                s,
                hat,
                &n,
                &gamma
            )
        };
        Ok(())
    }

    /// Gram-Schmidt on the columns of the row-major rows x cols matrices stored back to back in `p`.
    pub fn gram_schmidt(
        &self,
        p: &mut CudaViewMut<f32>,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        if rows * cols == 0 {
            return Ok(());
        }
        let matrices = p.len() / (rows * cols);
        let (r, c) = (u32_of(rows, "rows")?, u32_of(cols, "cols")?);
        // SAFETY: gram_schmidt(p, rows, cols, eps): block b works on the b-th rows x cols matrix, and the
        // grid has p.len() / (rows cols) blocks.
        unsafe { launch!(self, "gram_schmidt", grid(matrices), p, &r, &c, &eps) };
        Ok(())
    }
}
