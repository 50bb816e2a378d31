//! f32 matrix products through the gemm crate (the kernels candle's CPU backend uses), behind a safe
//! API: a matrix is a slice with its shape and strides, checked against the slice before gemm reads it.
//! The CPU engine's layers (`model::matmul`) and Muon's orthogonalisation (`optim::muon`) use it.

use gemm::Parallelism;

/// A matrix in a slice: rows x cols with row and column strides (a transpose swaps them).
#[derive(Clone, Copy)]
pub struct M<'a> {
    pub d: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> M<'a> {
    /// Row-major rows x cols.
    pub fn new(d: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::strided(d, rows, cols, cols)
    }

    /// rows x cols with rows `rs` apart (a column block of a wider row-major matrix).
    pub fn strided(d: &'a [f32], rows: usize, cols: usize, rs: usize) -> Self {
        Self {
            d,
            rows,
            cols,
            rs,
            cs: 1,
        }
    }

    /// Its `rows` rows from row r0, their first `cols` columns.
    pub fn part(self, r0: usize, rows: usize, cols: usize) -> Self {
        assert!(
            r0 + rows <= self.rows && cols <= self.cols,
            "part of a matrix past its edge"
        );
        Self {
            d: &self.d[(r0 * self.rs).min(self.d.len())..],
            rows,
            cols,
            ..self
        }
    }

    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// The last element it reads is inside the slice.
    pub(crate) fn fits(&self, len: usize) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < len
    }

    pub(crate) fn at(&self, i: usize, j: usize) -> f32 {
        self.d[i * self.rs + j * self.cs]
    }
}

/// The gemm threading for the current rayon pool.
pub fn par() -> Parallelism {
    match rayon::current_num_threads() {
        1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// The gemm threading for one product of `flops` multiply-adds: the current pool's threads from about
/// two million on; below, one thread (starting the threads costs more than they save).
pub fn par_for(flops: usize) -> Parallelism {
    match flops >= 1 << 21 {
        true => par(),
        false => Parallelism::None,
    }
}

/// Checks the shapes and bounds of out = a b; (m, n, k).
pub(crate) fn dims(out: &[f32], out_rs: usize, a: &M, b: &M) -> (usize, usize, usize) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    assert_eq!(k, b.rows, "inner dimensions");
    assert!(
        a.fits(a.d.len()) && b.fits(b.d.len()) && M::strided(out, m, n, out_rs).fits(out.len()),
        "matmul operand out of bounds"
    );
    (m, n, k)
}

/// out (a.rows x b.cols, row stride `out_rs`) = scale * a b, or += when `acc`.
pub fn mm(out: &mut [f32], out_rs: usize, a: M, b: M, acc: bool, scale: f32, par: Parallelism) {
    let (m, n, k) = dims(out, out_rs, &a, &b);
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: `dims` keeps every element gemm reads or writes inside its slice; `out` is borrowed
    // mutably, so it aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            out_rs as isize,
            acc,
            a.d.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.d.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            par,
        )
    }
}
