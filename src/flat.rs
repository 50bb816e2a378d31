//! Where a rank's flat buffers live (parameters, gradients, optimizer state): host memory, or the GPU
//! with `train.device = "cuda"`. One buffer per kind in name order, as `model::ParamSet` lays it out; on
//! the GPU the step's arithmetic runs as the kernels of `crate::cuda` (their CPU twins in
//! `crate::kernels` run on host buffers), and the host sees copies only for checkpoints, evaluations and
//! logged scalars.

use std::borrow::Cow;
use std::ops::Range;
#[cfg(feature = "cuda")]
use std::sync::Arc;

use anyhow::Result;
use candle_core::{Shape, Tensor};

#[cfg(feature = "cuda")]
use crate::cuda::Kernels;

/// A buffer on the GPU with the kernels (on the model's stream) that compute on it.
#[cfg(feature = "cuda")]
pub struct DeviceFlat {
    pub buf: cudarc::driver::CudaSlice<f32>,
    pub kernels: Arc<Kernels>,
}

/// An owned flat buffer.
pub enum Flat {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(DeviceFlat),
}

/// A flat buffer borrowed for writing.
pub enum FlatMut<'a> {
    Host(&'a mut [f32]),
    #[cfg(feature = "cuda")]
    Cuda(&'a mut DeviceFlat),
}

/// A flat buffer borrowed for reading.
#[derive(Clone, Copy)]
pub enum FlatRef<'a> {
    Host(&'a [f32]),
    #[cfg(feature = "cuda")]
    Cuda(&'a DeviceFlat),
}

/// Where new buffers go: host memory, or the GPU of the given kernels' stream.
#[derive(Clone, Default)]
pub enum Place {
    #[default]
    Host,
    #[cfg(feature = "cuda")]
    Cuda(Arc<Kernels>),
}

impl std::fmt::Debug for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Host => f.write_str("host"),
            #[cfg(feature = "cuda")]
            Place::Cuda(_) => f.write_str("cuda"),
        }
    }
}

/// The error of an operation given buffers in different places (a bug, not an input error).
#[cfg(feature = "cuda")]
pub const MIXED: &str =
    "internal error: flat buffers in host memory and on the GPU in one operation";

/// `n` zeros whose pages are mapped now, by one write each. Memory fresh from the OS reads as the shared
/// zero page until it is written, so a buffer first read and then written (an optimizer's moments) faults
/// twice per page, and the second fault flushes the TLB of every core running the process: with hundreds
/// of local workers, most of their first step.
pub fn mapped_zeros(n: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    // One f32 per 4 KiB page; black_box keeps the store that the zeroed allocation would make redundant.
    for i in (0..n).step_by(1024) {
        v[i] = std::hint::black_box(0.0);
    }
    v
}

impl Place {
    pub fn zeros(&self, n: usize) -> Result<Flat> {
        match self {
            Place::Host => Ok(Flat::Host(vec![0.0; n])),
            #[cfg(feature = "cuda")]
            Place::Cuda(k) => Ok(Flat::Cuda(DeviceFlat {
                buf: k.stream().alloc_zeros::<f32>(n)?,
                kernels: k.clone(),
            })),
        }
    }

    /// Zeros for state that is read before it is first written (an optimizer's moments and
    /// accumulators): on the host with its pages mapped now (see `mapped_zeros`).
    pub fn state_zeros(&self, n: usize) -> Result<Flat> {
        match self {
            Place::Host => Ok(Flat::Host(mapped_zeros(n))),
            #[cfg(feature = "cuda")]
            Place::Cuda(k) => Ok(Flat::Cuda(DeviceFlat {
                buf: k.stream().alloc_zeros::<f32>(n)?,
                kernels: k.clone(),
            })),
        }
    }

    /// Zeros for a buffer that collectives on another stream use in parts while the model's stream
    /// writes other parts (the gradient under DDP's overlap). On the GPU it is allocated outside
    /// cudarc's automatic event tracking, which would order every use of the buffer after the last use
    /// of any part of it on another stream, and so serialize the overlap; the collectives order the
    /// streams with events of their own (`Communicator::all_reduce_sum_device`, `finish_device`), and
    /// everything else that touches the buffer runs on the model's stream.
    pub fn zeros_for_collectives(&self, n: usize) -> Result<Flat> {
        match self {
            Place::Host => self.zeros(n),
            #[cfg(feature = "cuda")]
            Place::Cuda(k) => {
                let ctx = k.stream().context();
                let tracking = ctx.is_event_tracking();
                // SAFETY: the flag affects slices allocated while it is off: this one alone (a worker
                // allocates its buffers on its own thread before it starts). The buffer's cross-stream
                // uses are ordered by events, its collectives are waited for (`finish_device`) before
                // the model's stream writes the next step's gradient into it, and it is freed after.
                unsafe { ctx.disable_event_tracking() };
                let buf = k.stream().alloc_zeros::<f32>(n);
                if tracking {
                    // SAFETY: restores the context's flag as it was; slices allocated from here on are
                    // tracked again.
                    unsafe { ctx.enable_event_tracking() };
                }
                Ok(Flat::Cuda(DeviceFlat {
                    buf: buf?,
                    kernels: k.clone(),
                }))
            }
        }
    }

    /// `values` in this place (moved, on the host).
    pub fn from_host(&self, values: Vec<f32>) -> Result<Flat> {
        match self {
            Place::Host => Ok(Flat::Host(values)),
            #[cfg(feature = "cuda")]
            Place::Cuda(k) => Ok(Flat::Cuda(DeviceFlat {
                buf: k.stream().clone_htod(&values)?,
                kernels: k.clone(),
            })),
        }
    }
}

impl Flat {
    pub fn len(&self) -> usize {
        self.as_ref().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_ref(&self) -> FlatRef<'_> {
        match self {
            Flat::Host(v) => FlatRef::Host(v),
            #[cfg(feature = "cuda")]
            Flat::Cuda(d) => FlatRef::Cuda(d),
        }
    }

    pub fn as_mut(&mut self) -> FlatMut<'_> {
        match self {
            Flat::Host(v) => FlatMut::Host(v),
            #[cfg(feature = "cuda")]
            Flat::Cuda(d) => FlatMut::Cuda(d),
        }
    }

    /// The values on the host: borrowed there, a copy from the GPU.
    pub fn to_host(&self) -> Result<Cow<'_, [f32]>> {
        self.as_ref().to_host()
    }

    /// The values of a host buffer, moved out (an error for a GPU buffer).
    pub fn into_host_vec(self) -> Result<Vec<f32>> {
        match self {
            Flat::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Flat::Cuda(_) => {
                anyhow::bail!("internal error: a host buffer was expected, this one is on the GPU")
            }
        }
    }

    /// The values of a host buffer, for writing (an error for a GPU buffer).
    pub fn host_mut(&mut self) -> Result<&mut [f32]> {
        match self {
            Flat::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Flat::Cuda(_) => {
                anyhow::bail!("internal error: a host buffer was expected, this one is on the GPU")
            }
        }
    }

    /// Where this buffer is (for buffers made beside it).
    pub fn place(&self) -> Place {
        self.as_ref().place()
    }

    /// Moves this buffer's values to `place` (nothing to do where they are already).
    pub fn move_to(&mut self, place: &Place) -> Result<()> {
        let here = matches!((&*self, place), (Flat::Host(_), Place::Host));
        #[cfg(feature = "cuda")]
        let here = here || matches!((&*self, place), (Flat::Cuda(_), Place::Cuda(_)));
        if !here {
            *self = place.from_host(self.to_host()?.into_owned())?;
        }
        Ok(())
    }

    /// Whether this buffer has the length of `other` and lives in the same kind of memory.
    pub fn beside(&self, other: FlatRef<'_>) -> bool {
        let same_kind = match (self, other) {
            (Flat::Host(_), FlatRef::Host(_)) => true,
            #[cfg(feature = "cuda")]
            (Flat::Cuda(_), FlatRef::Cuda(_)) => true,
            #[cfg(feature = "cuda")]
            _ => false,
        };
        same_kind && self.len() == other.len()
    }
}

impl<'a> FlatRef<'a> {
    pub fn len(&self) -> usize {
        match self {
            FlatRef::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            FlatRef::Cuda(d) => d.buf.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values on the host: borrowed there, a copy from the GPU.
    pub fn to_host(self) -> Result<Cow<'a, [f32]>> {
        match self {
            FlatRef::Host(v) => Ok(Cow::Borrowed(v)),
            #[cfg(feature = "cuda")]
            FlatRef::Cuda(d) => Ok(Cow::Owned(d.kernels.stream().clone_dtoh(&d.buf)?)),
        }
    }

    /// Where this buffer is (for buffers made beside it).
    pub fn place(self) -> Place {
        match self {
            FlatRef::Host(_) => Place::Host,
            #[cfg(feature = "cuda")]
            FlatRef::Cuda(d) => Place::Cuda(d.kernels.clone()),
        }
    }

    /// A candle tensor of `shape` holding a copy of the values in `ranges`, one after the other: on the
    /// CPU, or on this buffer's GPU, where candle's operations (cuBLAS matmuls) run on its stream.
    pub fn tensor(self, ranges: &[Range<usize>], shape: impl Into<Shape>) -> Result<Tensor> {
        match self {
            FlatRef::Host(v) => {
                let n = ranges.iter().map(|r| r.len()).sum();
                let mut vals = Vec::with_capacity(n);
                ranges
                    .iter()
                    .for_each(|r| vals.extend_from_slice(&v[r.clone()]));
                Ok(Tensor::from_vec(vals, shape, &candle_core::Device::Cpu)?)
            }
            #[cfg(feature = "cuda")]
            FlatRef::Cuda(d) => {
                let s = d.kernels.stream();
                let n = ranges.iter().map(|r| r.len()).sum();
                let mut part = s.alloc_zeros::<f32>(n)?;
                let mut at = 0;
                for r in ranges {
                    s.memcpy_dtod(
                        &d.buf.slice(r.clone()),
                        &mut part.slice_mut(at..at + r.len()),
                    )?;
                    at += r.len();
                }
                d.kernels.tensor(part, shape)
            }
        }
    }

    /// The f64 sum of squares (the `sum_squares` kernel, or its twin on the host).
    pub fn sum_squares(self) -> Result<f64> {
        match self {
            FlatRef::Host(v) => Ok(crate::kernels::optim::sum_squares(v)),
            #[cfg(feature = "cuda")]
            FlatRef::Cuda(d) => d.kernels.sum_squares(&d.buf),
        }
    }
}

impl FlatMut<'_> {
    pub fn as_ref(&self) -> FlatRef<'_> {
        match self {
            FlatMut::Host(v) => FlatRef::Host(v),
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => FlatRef::Cuda(d),
        }
    }

    pub fn reborrow(&mut self) -> FlatMut<'_> {
        match self {
            FlatMut::Host(v) => FlatMut::Host(v),
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => FlatMut::Cuda(d),
        }
    }

    /// Sets every value to zero.
    pub fn fill_zero(&mut self) -> Result<()> {
        match self {
            FlatMut::Host(v) => v.iter_mut().for_each(|x| *x = 0.0),
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => d.kernels.stream().memset_zeros(&mut d.buf)?,
        }
        Ok(())
    }

    /// self[at..at + range.len()] = src[range].
    pub fn copy_from(&mut self, at: usize, src: FlatRef<'_>, range: Range<usize>) -> Result<()> {
        let n = range.len();
        match (self, src) {
            (FlatMut::Host(d), FlatRef::Host(x)) => d[at..at + n].copy_from_slice(&x[range]),
            #[cfg(feature = "cuda")]
            (FlatMut::Cuda(d), FlatRef::Cuda(x)) => d
                .kernels
                .stream()
                .memcpy_dtod(&x.buf.slice(range), &mut d.buf.slice_mut(at..at + n))?,
            #[cfg(feature = "cuda")]
            _ => anyhow::bail!(MIXED),
        }
        Ok(())
    }

    /// self[at..at + values.len()] = values (from host memory).
    pub fn copy_from_host(&mut self, at: usize, values: &[f32]) -> Result<()> {
        let n = values.len();
        match self {
            FlatMut::Host(d) => d[at..at + n].copy_from_slice(values),
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => d
                .kernels
                .stream()
                .memcpy_htod(values, &mut d.buf.slice_mut(at..at + n))?,
        }
        Ok(())
    }

    /// self[at..at + t.elem_count()] = the values of `t` (a tensor on this buffer's device).
    pub fn copy_from_tensor(&mut self, at: usize, t: &Tensor) -> Result<()> {
        let n = t.elem_count();
        match self {
            FlatMut::Host(d) => {
                d[at..at + n].copy_from_slice(&t.flatten_all()?.to_vec1::<f32>()?);
            }
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => {
                let t = t.contiguous()?;
                let (storage, layout) = t.storage_and_layout();
                let candle_core::Storage::Cuda(c) = &*storage else {
                    anyhow::bail!(MIXED);
                };
                let o = layout.start_offset();
                let src = c.as_cuda_slice::<f32>()?.slice(o..o + n);
                let s = d.kernels.stream().clone();
                s.memcpy_dtod(&src, &mut d.buf.slice_mut(at..at + n))?;
            }
        }
        Ok(())
    }

    /// self += src (the `ef_accumulate` kernel, or its twin on the host).
    pub fn add(&mut self, src: FlatRef<'_>) -> Result<()> {
        match (self, src) {
            (FlatMut::Host(d), FlatRef::Host(x)) => crate::kernels::ef_accumulate(d, x),
            #[cfg(feature = "cuda")]
            (FlatMut::Cuda(d), FlatRef::Cuda(x)) => d.kernels.ef_accumulate(&mut d.buf, &x.buf)?,
            #[cfg(feature = "cuda")]
            _ => anyhow::bail!(MIXED),
        }
        Ok(())
    }

    /// Gram-Schmidt on the columns of the row-major rows x cols matrices stored back to back in
    /// self[range] (the `gram_schmidt` kernel, or its twin on the host).
    pub fn gram_schmidt(
        &mut self,
        range: Range<usize>,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        match self {
            FlatMut::Host(d) => crate::kernels::gram_schmidt(&mut d[range], rows, cols, eps),
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => {
                let k = d.kernels.clone();
                k.gram_schmidt(&mut d.buf.slice_mut(range), rows, cols, eps)?
            }
        }
        Ok(())
    }

    /// self = own * self + b (the `mix` kernel, or its twin on the host).
    pub fn mix(&mut self, b: FlatRef<'_>, own: f32) -> Result<()> {
        match (self, b) {
            (FlatMut::Host(x), FlatRef::Host(b)) => crate::kernels::mix(x, b, own),
            #[cfg(feature = "cuda")]
            (FlatMut::Cuda(x), FlatRef::Cuda(b)) => {
                let k = x.kernels.clone();
                k.mix(&mut x.buf.slice_mut(..), &b.buf.slice(..), own)?
            }
            #[cfg(feature = "cuda")]
            _ => anyhow::bail!(MIXED),
        }
        Ok(())
    }

    /// self = src * s (the `scaled_copy` kernel, or its twin on the host).
    pub fn assign_scaled(&mut self, src: FlatRef<'_>, s: f32) -> Result<()> {
        match (self, src) {
            (FlatMut::Host(d), FlatRef::Host(x)) => crate::kernels::scaled_copy(d, x, s),
            #[cfg(feature = "cuda")]
            (FlatMut::Cuda(d), FlatRef::Cuda(x)) => {
                let k = d.kernels.clone();
                k.scaled_copy(&mut d.buf.slice_mut(..), &x.buf.slice(..), s)?
            }
            #[cfg(feature = "cuda")]
            _ => anyhow::bail!(MIXED),
        }
        Ok(())
    }

    /// Runs `f`, which works on host memory, on this buffer: in place on the host; on the GPU through a
    /// copy down and back up (the hooks of the sync backends that have no device path yet).
    pub fn through_host<T>(self, f: impl FnOnce(&mut [f32]) -> Result<T>) -> Result<T> {
        match self {
            FlatMut::Host(v) => f(v),
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => {
                let stream = d.kernels.stream().clone();
                let mut host = stream.clone_dtoh(&d.buf)?;
                let out = f(&mut host)?;
                stream.memcpy_htod(&host, &mut d.buf)?;
                Ok(out)
            }
        }
    }
}

impl<'a> From<&'a mut [f32]> for FlatMut<'a> {
    fn from(v: &'a mut [f32]) -> Self {
        FlatMut::Host(v)
    }
}

impl<'a> From<&'a mut Vec<f32>> for FlatMut<'a> {
    fn from(v: &'a mut Vec<f32>) -> Self {
        FlatMut::Host(v)
    }
}

impl<'a> From<&'a [f32]> for FlatRef<'a> {
    fn from(v: &'a [f32]) -> Self {
        FlatRef::Host(v)
    }
}

impl<'a> From<&'a Vec<f32>> for FlatRef<'a> {
    fn from(v: &'a Vec<f32>) -> Self {
        FlatRef::Host(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_zeros_are_zeros_of_every_length() {
        for n in [0, 1, 1023, 1024, 1025, 5000] {
            let v = Place::Host.state_zeros(n).unwrap().into_host_vec().unwrap();
            assert_eq!(v, vec![0.0f32; n]);
        }
    }

    #[test]
    fn host_buffers_are_borrowed_in_place_and_changed_in_place() {
        let mut f = Place::Host.from_host(vec![3.0, 4.0]).unwrap();
        assert!(matches!(f.to_host().unwrap(), Cow::Borrowed(_)));
        assert_eq!(f.as_ref().sum_squares().unwrap(), 25.0);
        let doubled = f
            .as_mut()
            .through_host(|v| {
                v.iter_mut().for_each(|x| *x *= 2.0);
                Ok(v.len())
            })
            .unwrap();
        assert_eq!((doubled, &*f.to_host().unwrap()), (2, &[6.0f32, 8.0][..]));
        f.as_mut().fill_zero().unwrap();
        assert_eq!(&*f.to_host().unwrap(), &[0.0, 0.0]);
        assert_eq!(Place::Host.zeros(3).unwrap().len(), 3);
    }
}
