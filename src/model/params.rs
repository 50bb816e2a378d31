//! The model's parameters as one name-sorted set with a flat f32 view. Gradient communication, the
//! optimizer and checkpoints all work on the flat view, in the same order on every process (a HashMap's
//! order is not: see DESIGN.md). A set made for candle's graph holds a tensor per parameter; a set made
//! for the CPU engine holds only the layout (the engine computes from the caller's flat weights, so a
//! worker keeps one copy of its parameters, not two).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};

/// One parameter: its place in the flat buffer, and its candle `Var` in a set made for the graph.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    pub var: Option<Var>,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub len: usize,
}

impl Param {
    /// nanoGPT's optimizer groups: weight decay on matrices and embeddings (rank >= 2) only.
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
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

    /// Adds the gradients of `grads` into `flat` (name order), treating a missing gradient as zero.
    pub fn accumulate_grads(
        &self,
        grads: &candle_core::backprop::GradStore,
        flat: &mut [f32],
    ) -> Result<()> {
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
        Ok(())
    }
}
