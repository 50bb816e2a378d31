//! The model's parameters as one name-sorted set with a flat f32 view. Gradient communication, the
//! optimizer and checkpoints all work on the flat view, in the same order on every process (a HashMap's
//! order is not: see DESIGN.md).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};

/// One parameter: a candle `Var` and its place in the flat buffer.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    pub var: Var,
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
    /// Builds the set from (name, initial values, shape); sorts by name.
    pub fn new(mut items: Vec<(String, Vec<f32>, Vec<usize>)>, device: &Device) -> Result<Self> {
        items.sort_by(|a, b| a.0.cmp(&b.0));
        let mut params = Vec::with_capacity(items.len());
        let mut offset = 0;
        for (name, values, shape) in items {
            let len = values.len();
            if len != shape.iter().product::<usize>() {
                bail!("parameter {name}: {len} values for shape {shape:?}");
            }
            let t = Tensor::from_vec(values, shape.as_slice(), device)?;
            params.push(Param {
                name,
                var: Var::from_tensor(&t)?,
                shape,
                offset,
                len,
            });
            offset += len;
        }
        Ok(Self {
            params,
            numel: offset,
        })
    }

    pub fn get(&self, name: &str) -> Result<&Tensor> {
        match self.params.binary_search_by(|p| p.name.as_str().cmp(name)) {
            Ok(i) => Ok(self.params[i].var.as_tensor()),
            Err(_) => bail!("no parameter named {name}"),
        }
    }

    /// The current values, flattened in name order.
    pub fn to_flat(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.numel);
        for p in &self.params {
            out.extend(p.var.as_tensor().flatten_all()?.to_vec1::<f32>()?);
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
            let t = Tensor::from_slice(
                &flat[p.offset..p.offset + p.len],
                p.shape.as_slice(),
                p.var.device(),
            )?;
            p.var.set(&t)?;
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
            if let Some(g) = grads.get(p.var.as_tensor()) {
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
