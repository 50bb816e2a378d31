//! The model's parameters as one name-sorted set with a flat f32 view. Gradient communication, the
//! optimizer and checkpoints all work on the flat view, in the same order on every process (a HashMap's
//! order is not: see DESIGN.md). A set made for candle's graph holds a tensor per parameter; a set made
//! for the CPU engine holds only the layout (the engine computes from the caller's flat weights, so a
//! worker keeps one copy of its parameters, not two).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};

use crate::flat::FlatMut;
use crate::kernels::Segment;

/// One parameter: its place in the flat buffer, and its candle `Var` in a set made for the graph.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    pub var: Option<Var>,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub len: usize,
}

/// All parameters, sorted by name, with offsets into a flat buffer.
#[derive(Debug, Clone)]
pub struct ParamSet {
    pub params: Vec<Param>,
    pub numel: usize,
}

impl ParamSet {
    /// Builds the set from (name, initial values, shape), with a tensor per parameter; sorts by name.
    pub fn new(mut items: Vec<(String, Vec<f32>, Vec<usize>)>, device: &Device) -> Result<Self> {
        items.sort_by(|a, b| a.0.cmp(&b.0));
        let mut set = Self::layout(
            items
                .iter()
                .map(|(n, _, s)| (n.clone(), s.clone()))
                .collect(),
        );
        for (p, (name, values, shape)) in set.params.iter_mut().zip(items) {
            if values.len() != p.len {
                bail!(
                    "parameter {name}: {} values for shape {shape:?}",
                    values.len()
                );
            }
            let t = Tensor::from_vec(values, shape.as_slice(), device)?;
            p.var = Some(Var::from_tensor(&t)?);
        }
        Ok(set)
    }

    /// Where each parameter lies in the flat buffer, and its shape as a matrix: the layout the optimizers
    /// and the backends step over.
    pub fn segments(&self) -> Vec<Segment> {
        Segment::of_shapes(
            self.params
                .iter()
                .map(|p| (p.name.clone(), p.shape.clone())),
        )
    }

    /// Whether each parameter, in `segments` order, is a hidden matrix: one of the blocks' four
    /// projections (Muon's group; embeddings, the head tied to them, norms and biases are not).
    pub fn hidden_matrices(&self) -> Vec<bool> {
        self.params
            .iter()
            .map(|p| p.shape.len() == 2 && super::gpt::is_conv1d(&p.name))
            .collect()
    }

    /// The set's layout alone, from (name, shape): no tensors (see the module's note).
    pub fn layout(mut items: Vec<(String, Vec<usize>)>) -> Self {
        items.sort_by(|a, b| a.0.cmp(&b.0));
        let mut offset = 0;
        let params = items
            .into_iter()
            .map(|(name, shape)| {
                let len = shape.iter().product();
                let p = Param {
                    name,
                    var: None,
                    shape,
                    offset,
                    len,
                };
                offset += len;
                p
            })
            .collect();
        Self {
            params,
            numel: offset,
        }
    }

    /// The flat range of the parameters whose names start with `prefix` (they are contiguous: the set
    /// is sorted by name).
    pub fn range_of(&self, prefix: &str) -> Result<std::ops::Range<usize>> {
        let mut of = self.params.iter().filter(|p| p.name.starts_with(prefix));
        let first = of
            .next()
            .with_context(|| format!("no parameter under {prefix}"))?;
        let end = of.fold(first.offset + first.len, |end, p| {
            debug_assert_eq!(p.offset, end, "parameters under {prefix} are contiguous");
            p.offset + p.len
        });
        Ok(first.offset..end)
    }

    fn var(p: &Param) -> Result<&Var> {
        p.var.as_ref().with_context(|| {
            format!(
                "parameter {} has no tensor: this model computes on the CPU engine, from flat weights",
                p.name
            )
        })
    }

    pub fn get(&self, name: &str) -> Result<&Tensor> {
        match self.params.binary_search_by(|p| p.name.as_str().cmp(name)) {
            Ok(i) => Ok(Self::var(&self.params[i])?.as_tensor()),
            Err(_) => bail!("no parameter named {name}"),
        }
    }

    /// The current values of the tensors, flattened in name order.
    pub fn to_flat(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.numel);
        for p in &self.params {
            out.extend(Self::var(p)?.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Sets every parameter from a flat buffer in name order.
    pub fn set_flat(&self, flat: &[f32]) -> Result<()> {
        if flat.len() != self.numel {
            bail!(
                "flat buffer of {} values for {} parameters",
                flat.len(),
                self.numel
            );
        }
        for p in &self.params {
            let var = Self::var(p)?;
            let t = Tensor::from_slice(
                &flat[p.offset..p.offset + p.len],
                p.shape.as_slice(),
                var.device(),
            )?;
            var.set(&t)?;
        }
        Ok(())
    }

    /// Adds the gradients of `grads` into `flat` (name order), treating a missing gradient as zero: on
    /// the host, or on the GPU where the gradients are (no copy through host memory).
    pub fn accumulate_grads(
        &self,
        grads: &candle_core::backprop::GradStore,
        flat: FlatMut<'_>,
    ) -> Result<()> {
        match flat {
            FlatMut::Host(flat) => {
                for p in &self.params {
                    if let Some(g) = grads.get(Self::var(p)?.as_tensor()) {
                        let g = g.to_dtype(DType::F32)?.flatten_all()?;
                        let g = g
                            .to_vec1::<f32>()
                            .with_context(|| format!("gradient of {}", p.name))?;
                        for (a, b) in flat[p.offset..p.offset + p.len].iter_mut().zip(&g) {
                            *a += b;
                        }
                    }
                }
            }
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) => {
                for p in &self.params {
                    if let Some(g) = grads.get(Self::var(p)?.as_tensor()) {
                        let g = g.to_dtype(DType::F32)?.contiguous()?;
                        let (storage, layout) = g.storage_and_layout();
                        let candle_core::Storage::Cuda(cs) = &*storage else {
                            bail!("gradient of {} is not on the GPU", p.name);
                        };
                        let at = layout.start_offset();
                        let src = cs.as_cuda_slice::<f32>()?.slice(at..at + p.len);
                        d.kernels.add_at(&mut d.buf, p.offset, &src)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets every parameter from a flat buffer on the GPU: a device-to-device copy per tensor.
    #[cfg(feature = "cuda")]
    pub fn set_flat_device(&self, flat: &crate::flat::DeviceFlat) -> Result<()> {
        if flat.buf.len() != self.numel {
            bail!(
                "flat buffer of {} values for {} parameters",
                flat.buf.len(),
                self.numel
            );
        }
        let stream = flat.kernels.stream();
        for p in &self.params {
            let var = Self::var(p)?;
            if !var.device().is_cuda() {
                bail!("parameter {} is not on the GPU", p.name);
            }
            let mut part = stream.alloc_zeros::<f32>(p.len)?;
            stream.memcpy_dtod(&flat.buf.slice(p.offset..p.offset + p.len), &mut part)?;
            var.set(&flat.kernels.tensor(part, p.shape.as_slice())?)?;
        }
        // The weights are in place before the host goes on: work that another stream queues next (an
        // overlapped gossip's, NCCL's) reads them without an event of its own.
        stream.synchronize()?;
        Ok(())
    }
}
