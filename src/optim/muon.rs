//! Muon (Keller Jordan's `SingleDeviceMuonWithAuxAdam`, github.com/KellerJordan/Muon): momentum SGD on
//! the hidden matrices whose update is orthogonalised by a quintic Newton-Schulz iteration, and AdamW on
//! every other parameter (embeddings and the head tied to them, norms, biases) at `adam_lr_ratio` times
//! the learning rate. Per hidden matrix G (rows x cols), step t:
//!
//! ```text
//! m = m + (1 - beta) (g - m)                    (momentum.lerp_(grad, 1 - beta))
//! u = g + beta (m - g)  (Nesterov; else u = m)
//! X = NS5(u) sqrt(max(1, rows / cols))
//! p = (1 - lr wd) p - lr X
//! ```
//!
//! NS5 transposes a tall matrix, divides by its Frobenius norm + 1e-7, and repeats `ns_steps` times
//! A = X X^T, B = b A + c A A, X = a X + B X with (a, b, c) = (3.4445, -4.7750, 2.0315). The reference runs
//! it in bf16 on GPUs; this one in f32. The update of a matrix needs all of it, so Muon has no range
//! update (`step_shard`): the local engine's workers keep replicas of their own under it.

use anyhow::{bail, Result};

use super::optimizer::{take, OptimState, OptimView, Optimizer, Segments, Shard};
use crate::config::MuonConfig;
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::gemm::{mm, par, M};
use crate::kernels::optim as kernels;
use crate::kernels::Segment;

/// The quintic iteration's coefficients (the reference's).
const NS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);

pub struct Muon {
    cfg: MuonConfig,
    /// The hidden matrices (Muon's group) and the other segments (AdamW's).
    hidden: Vec<Segment>,
    adam: Segments,
    /// Momentum of the hidden matrices, AdamW's moments of the others (whole-model buffers).
    momentum: Flat,
    m: Flat,
    v: Flat,
    t: u64,
}

impl Muon {
    /// `hidden[i]`: whether segment i is a hidden matrix (Muon's group).
    pub(super) fn new(
        c: &MuonConfig,
        segs: Segments,
        hidden: &[bool],
        numel: usize,
        place: &Place,
    ) -> Result<Self> {
        if !matches!(place, Place::Host) {
            bail!(crate::error::BadInput(
                "train.optim.name = \"muon\" runs on the CPU only: set train.device = \"cpu\", or choose \
                 \"adamw\" on a GPU"
                    .into()
            ));
        }
        if hidden.len() != segs.host.len() {
            bail!(
                "internal error: Muon's groups name {} segments, the model has {}",
                hidden.len(),
                segs.host.len()
            );
        }
        let (mut muon, mut adam) = (Vec::new(), Vec::new());
        for (s, &h) in segs.host.iter().zip(hidden) {
            match h && s.matrix {
                true => muon.push(*s),
                false => adam.push(*s),
            }
        }
        Ok(Self {
            cfg: *c,
            hidden: muon,
            adam: Segments::new(adam),
            momentum: place.state_zeros(numel)?,
            m: place.state_zeros(numel)?,
            v: place.state_zeros(numel)?,
            t: 0,
        })
    }
}

/// Buffer names, in `view`'s order.
const BUFFERS: [&str; 3] = ["momentum_buffer", "exp_avg", "exp_avg_sq"];

impl Optimizer for Muon {
    fn step_scaled(
        &mut self,
        params: FlatMut<'_>,
        grads: FlatRef<'_>,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()> {
        self.t += 1;
        let (p, g) = match (params, grads) {
            (FlatMut::Host(p), FlatRef::Host(g)) => (p, g),
            #[cfg(feature = "cuda")]
            _ => bail!("train.optim.name = \"muon\" runs on the CPU only"),
        };
        let [mom, m, v] = [&mut self.momentum, &mut self.m, &mut self.v].map(|b| b.host_mut());
        let (mom, m, v) = (mom?, m?, v?);
        for s in &self.hidden {
            let r = s.range();
            muon_matrix(
                &self.cfg,
                s,
                &mut p[r.clone()],
                &g[r.clone()],
                &mut mom[r],
                lr,
                grad_scale,
            );
        }
        let c = self.cfg;
        let step = kernels::AdamWStep {
            grad_scale,
            ..kernels::AdamWStep::new(
                c.adam_betas,
                c.adam_eps,
                c.adam_weight_decay,
                lr * c.adam_lr_ratio,
                self.t,
            )
        };
        kernels::adamw(p, g, m, v, &self.adam.host, &step);
        Ok(())
    }

    fn view(&self) -> OptimView<'_> {
        OptimView {
            name: "muon",
            step: self.t,
            buffers: BUFFERS
                .into_iter()
                .zip([&self.momentum, &self.m, &self.v])
                .map(|(n, b)| (n, b.as_ref()))
                .collect(),
        }
    }

    fn load_state(&mut self, state: OptimState) -> Result<()> {
        let n = self.m.len();
        let [mom, m, v] = take(state, "muon", BUFFERS, n, &mut self.t)?;
        (self.momentum, self.m, self.v) = (Flat::Host(mom), Flat::Host(m), Flat::Host(v));
        Ok(())
    }

    fn step_shard(&self, _: Shard<'_>, _: u64, _: f64, _: f32) -> Result<()> {
        bail!("internal error: Muon updates whole matrices and has no range update")
    }

    fn host_state_mut(&mut self) -> Result<Vec<&mut [f32]>> {
        let [a, b, c] = [&mut self.momentum, &mut self.m, &mut self.v].map(|b| b.host_mut());
        Ok(vec![a?, b?, c?])
    }
}

/// One hidden matrix's step (the module's recurrence).
fn muon_matrix(
    c: &MuonConfig,
    s: &Segment,
    p: &mut [f32],
    g: &[f32],
    mom: &mut [f32],
    lr: f64,
    grad_scale: f32,
) {
    let beta = c.momentum as f32;
    let mut u: Vec<f32> = g.iter().map(|&x| x * grad_scale).collect();
    for (m, &gi) in mom.iter_mut().zip(&u) {
        *m += (1.0 - beta) * (gi - *m);
    }
    match c.nesterov {
        true => u
            .iter_mut()
            .zip(&*mom)
            .for_each(|(x, &m)| *x += beta * (m - *x)),
        false => u.copy_from_slice(mom),
    }
    let x = newton_schulz(&u, s.rows, s.cols, c.ns_steps);
    let scale = (s.rows as f32 / s.cols as f32).max(1.0).sqrt();
    let (decay, step) = ((1.0 - lr * c.weight_decay) as f32, lr as f32 * scale);
    for (pi, xi) in p.iter_mut().zip(x) {
        *pi = *pi * decay - step * xi;
    }
}

/// NS5 of the row-major `rows x cols` matrix `g` (see the module's doc), row-major in its own shape.
pub fn newton_schulz(g: &[f32], rows: usize, cols: usize, steps: u32) -> Vec<f32> {
    let tall = rows > cols;
    let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
    let norm = g.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt() as f32 + 1e-7;
    // X (r x k, r <= k), row-major.
    let mut x = vec![0.0f32; r * k];
    let src = if tall {
        M::new(g, rows, cols).t()
    } else {
        M::new(g, rows, cols)
    };
    for i in 0..r {
        for j in 0..k {
            x[i * k + j] = src.at(i, j) / norm;
        }
    }
    let (a, b, cc) = NS;
    let (mut gram, mut poly, mut next) = (vec![0.0; r * r], vec![0.0; r * r], vec![0.0; r * k]);
    for _ in 0..steps {
        let xm = M::new(&x, r, k);
        mm(&mut gram, r, xm, xm.t(), false, 1.0, par());
        // B = b A + c A A.
        mm(
            &mut poly,
            r,
            M::new(&gram, r, r),
            M::new(&gram, r, r),
            false,
            cc,
            par(),
        );
        poly.iter_mut().zip(&gram).for_each(|(p, &ga)| *p += b * ga);
        // X = a X + B X.
        next.iter_mut().zip(&x).for_each(|(n, &xi)| *n = a * xi);
        mm(&mut next, k, M::new(&poly, r, r), xm, true, 1.0, par());
        std::mem::swap(&mut x, &mut next);
    }
    if !tall {
        return x;
    }
    let xt = M::new(&x, r, k).t();
    (0..rows)
        .flat_map(|i| (0..cols).map(move |j| (i, j)))
        .map(|(i, j)| xt.at(i, j))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// a (n x k) b (k x m), row-major, f64.
    fn matmul(a: &[f64], b: &[f64], n: usize, k: usize, m: usize) -> Vec<f64> {
        let mut c = vec![0.0; n * m];
        for i in 0..n {
            for p in 0..k {
                for j in 0..m {
                    c[i * m + j] += a[i * k + p] * b[p * m + j];
                }
            }
        }
        c
    }

    fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        (0..cols * rows)
            .map(|i| a[(i % rows) * cols + i / rows])
            .collect()
    }

    /// The reference's zeropower_via_newtonschulz5, line for line, in f64.
    fn reference_ns(g: &[f32], rows: usize, cols: usize, steps: u32) -> Vec<f64> {
        let g: Vec<f64> = g.iter().map(|&x| x as f64).collect();
        let tall = rows > cols;
        let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
        let mut x = if tall { transpose(&g, rows, cols) } else { g };
        let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt() + 1e-7;
        x.iter_mut().for_each(|v| *v /= norm);
        let (a, b, c) = (3.4445, -4.7750, 2.0315);
        for _ in 0..steps {
            let gram = matmul(&x, &transpose(&x, r, k), r, k, r);
            let gg = matmul(&gram, &gram, r, r, r);
            let poly: Vec<f64> = gram.iter().zip(&gg).map(|(p, q)| b * p + c * q).collect();
            let bx = matmul(&poly, &x, r, r, k);
            x = x.iter().zip(&bx).map(|(xi, y)| a * xi + y).collect();
        }
        if tall {
            transpose(&x, r, k)
        } else {
            x
        }
    }

    fn max_diff(a: &[f32], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y).abs())
            .fold(0.0, f64::max)
    }

    /// The f32 iteration equals the reference's in f64 on wide, square and tall random matrices.
    #[test]
    fn newton_schulz_equals_the_reference() {
        for (i, &(rows, cols)) in [(16, 48), (32, 32), (40, 12), (1, 9)].iter().enumerate() {
            let g = random(rows * cols, i as u64);
            let d = max_diff(
                &newton_schulz(&g, rows, cols, 5),
                &reference_ns(&g, rows, cols, 5),
            );
            assert!(d < 1e-5, "{rows}x{cols}: {d}");
        }
    }

    /// The eigenvalues of a symmetric matrix (n x n, f64) by cyclic Jacobi rotations.
    fn eigenvalues(mut a: Vec<f64>, n: usize) -> Vec<f64> {
        for _ in 0..100 {
            for p in 0..n {
                for q in p + 1..n {
                    let apq = a[p * n + q];
                    if apq.abs() < 1e-15 {
                        continue;
                    }
                    let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                    let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                    let c = 1.0 / (t * t + 1.0).sqrt();
                    let s = t * c;
                    for k in 0..n {
                        let (akp, akq) = (a[k * n + p], a[k * n + q]);
                        a[k * n + p] = c * akp - s * akq;
                        a[k * n + q] = s * akp + c * akq;
                    }
                    for k in 0..n {
                        let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                        a[p * n + k] = c * apk - s * aqk;
                        a[q * n + k] = s * apk + c * aqk;
                    }
                }
            }
        }
        (0..n).map(|i| a[i * n + i]).collect()
    }

    /// Orthogonalisation: the singular values of NS5(G) lie near 1 (the reference's S' of about 0.7 to
    /// 1.2), where G's spread over two orders of magnitude.
    #[test]
    fn orthogonalised_updates_have_singular_values_near_one() {
        let (r, k) = (12, 40);
        let mut g = random(r * k, 7);
        // Rows scaled 1 .. 100: G's singular values spread.
        for i in 0..r {
            g[i * k..(i + 1) * k]
                .iter_mut()
                .for_each(|x| *x *= 1.5f32.powi(i as i32));
        }
        let x: Vec<f64> = newton_schulz(&g, r, k, 5)
            .iter()
            .map(|&v| v as f64)
            .collect();
        let gram = matmul(&x, &transpose(&x, r, k), r, k, r);
        for e in eigenvalues(gram, r) {
            let s = e.max(0.0).sqrt();
            assert!((0.65..=1.25).contains(&s), "singular value {s}");
        }
    }

    /// SingleDeviceMuonWithAuxAdam's steps, line for line in f64: Muon on the hidden matrices, Adam on
    /// the rest (whose weight decay, as AdamW's here, applies to matrices only: nanoGPT's groups).
    fn reference_steps(
        c: &MuonConfig,
        segs: &[(Segment, bool)],
        p: &mut [f64],
        grads: &[Vec<f32>],
        lr: f64,
    ) {
        let n = p.len();
        let (mut mom, mut m, mut v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            for (s, hidden) in segs {
                let r = s.range();
                if *hidden {
                    let beta = c.momentum;
                    let mut u = vec![0.0f32; s.len];
                    for (j, i) in r.clone().enumerate() {
                        mom[i] += (1.0 - beta) * (g[i] as f64 - mom[i]);
                        u[j] = (g[i] as f64 + beta * (mom[i] - g[i] as f64)) as f32;
                    }
                    let x = reference_ns(&u, s.rows, s.cols, c.ns_steps);
                    let scale = (s.rows as f64 / s.cols as f64).max(1.0).sqrt();
                    for (j, i) in r.enumerate() {
                        p[i] = p[i] * (1.0 - lr * c.weight_decay) - lr * scale * x[j];
                    }
                } else {
                    let ([b1, b2], lr) = (c.adam_betas, lr * c.adam_lr_ratio);
                    let wd = if s.matrix { c.adam_weight_decay } else { 0.0 };
                    for i in r {
                        let gi = g[i] as f64;
                        m[i] += (1.0 - b1) * (gi - m[i]);
                        v[i] += (1.0 - b2) * (gi * gi - v[i]);
                        let (mc, vc) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
                        p[i] = p[i] * (1.0 - lr * wd) - lr * mc / (vc.sqrt() + c.adam_eps);
                    }
                }
            }
        }
    }

    /// Three steps on a tall hidden matrix (scaled by sqrt(rows / cols)), an embedding and a bias equal
    /// the reference's; the checkpointed state continues bit for bit.
    #[test]
    fn muon_steps_equal_the_reference_and_resume_exactly() {
        let segs = Segment::from_shapes(&[(24, 8, true), (10, 6, true), (6, 1, false)]);
        let hidden = [true, false, false];
        let n: usize = segs.iter().map(|s| s.len).sum();
        let c = MuonConfig {
            weight_decay: 0.1,
            adam_weight_decay: 0.05,
            adam_eps: 1e-8,
            ..MuonConfig::default()
        };
        let cfg = crate::config::OptimConfig::Muon(c);
        let mut opt = super::super::build(&cfg, segs.clone(), &hidden, n, &Place::Host).unwrap();
        let p0 = random(n, 1);
        let grads: Vec<Vec<f32>> = (0..3).map(|s| random(n, 10 + s)).collect();
        let mut p = p0.clone();
        for g in &grads {
            opt.step((&mut p[..]).into(), (&g[..]).into(), 0.02)
                .unwrap();
        }
        let mut want: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
        let tagged: Vec<(Segment, bool)> = segs.iter().copied().zip(hidden).collect();
        reference_steps(&c, &tagged, &mut want, &grads, 0.02);
        let d = max_diff(&p, &want);
        assert!(d < 1e-5, "{d}");
        // Resume: a fresh optimizer with the saved state takes the same next step.
        let mut other = super::super::build(&cfg, segs, &hidden, n, &Place::Host).unwrap();
        other.load_state(opt.state().unwrap()).unwrap();
        let (mut a, mut b) = (p.clone(), p);
        opt.step((&mut a[..]).into(), (&grads[0][..]).into(), 0.01)
            .unwrap();
        other
            .step((&mut b[..]).into(), (&grads[0][..]).into(), 0.01)
            .unwrap();
        assert_eq!(a, b);
    }
}
