//! Strided single-precision matrix multiply over slices, through the `gemm` crate (single-threaded:
//! the CPU backend already runs one thread per rank).
//!
//! Every view is checked against its slice before the call (this module's one `unsafe` block), so
//! a shape mistake panics instead of reading out of bounds. Transposes are strides, never copies.

/// A read-only matrix view: element (i, j) is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major matrix whose rows are `ld` elements apart.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize, ld: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            rs: ld,
            cs: 1,
        }
    }

    /// A contiguous row-major matrix.
    pub fn dense(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::rows(data, rows, cols, cols)
    }

    pub fn t(self) -> Self {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// A writable matrix view (row-major with leading dimension `ld`).
pub(crate) struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

impl<'a> MatMut<'a> {
    pub fn rows(data: &'a mut [f32], rows: usize, cols: usize, ld: usize) -> Self {
        MatMut {
            data,
            rows,
            cols,
            ld,
        }
    }

    pub fn dense(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::rows(data, rows, cols, cols)
    }
}

fn fits(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
}

/// C ← α·A·B + β·C. With β = 0, C is written without being read.
pub(crate) fn gemm(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: MatMut<'_>) {
    assert_eq!(a.cols, b.rows, "gemm: inner dimensions differ");
    assert_eq!(
        (c.rows, c.cols),
        (a.rows, b.cols),
        "gemm: output shape differs"
    );
    assert!(
        fits(a.data.len(), a.rows, a.cols, a.rs, a.cs),
        "gemm: A out of bounds"
    );
    assert!(
        fits(b.data.len(), b.rows, b.cols, b.rs, b.cs),
        "gemm: B out of bounds"
    );
    assert!(
        fits(c.data.len(), c.rows, c.cols, c.ld, 1),
        "gemm: C out of bounds"
    );
    assert!(c.cols <= c.ld || c.rows <= 1, "gemm: C rows overlap");
    if c.rows == 0 || c.cols == 0 {
        return;
    }
    if a.cols == 0 {
        // An empty sum: C ← β·C (β = 0 writes zeros without reading C).
        for row in c.data.chunks_mut(c.ld).take(c.rows) {
            for v in &mut row[..c.cols] {
                *v = if beta == 0.0 { 0.0 } else { beta * *v };
            }
        }
        return;
    }
    // SAFETY: the asserts above keep every element of A, B and C inside its slice, C's rows do not
    // overlap, and C is borrowed mutably so it aliases neither A nor B. `gemm` computes
    // dst ← α'·dst + β'·lhs·rhs (dst read only when asked), so our α and β trade places.
    unsafe {
        gemm::gemm(
            c.rows,
            c.cols,
            a.cols,
            c.data.as_mut_ptr(),
            1,
            c.ld as isize,
            beta != 0.0,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            beta,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// A linear layer's product over `t` token rows (PyTorch's `Linear`) on host slices: the input
/// x [t, inp] and the weight w [out, inp], each in contiguous rows (the device layer's `Linear`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product<'a> {
    pub x: &'a [f32],
    pub w: &'a [f32],
    pub t: usize,
    pub inp: usize,
    pub out: usize,
}

/// y (+)= x·Wᵀ (+ bias): y is [t, out] in rows `ld` apart.
pub(crate) fn linear(
    p: Product<'_>,
    bias: Option<&[f32]>,
    (y, ld): (&mut [f32], usize),
    beta: f32,
) {
    let Product { x, w, t, inp, out } = p;
    gemm(
        1.0,
        Mat::dense(x, t, inp),
        Mat::dense(w, out, inp).t(),
        beta,
        MatMut::rows(y, t, out, ld),
    );
    if let Some(b) = bias {
        for row in y.chunks_mut(ld).take(t) {
            for (v, &bb) in row[..out].iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
}

/// The backward of [`linear`]: dW += dyᵀ·x, dbias += Σ_rows dy, and dx (β)= dy·W when wanted,
/// dy in rows `ld` apart.
pub(crate) fn linear_backward(
    p: Product<'_>,
    (dy, ld): (&[f32], usize),
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
    dx: Option<(&mut [f32], f32)>,
) {
    let Product { x, t, inp, out, .. } = p;
    let dy_rows = Mat::rows(dy, t, out, ld);
    gemm(
        1.0,
        dy_rows.t(),
        Mat::dense(x, t, inp),
        1.0,
        MatMut::dense(dw, out, inp),
    );
    if let Some(db) = dbias {
        col_sums(dy, (out, ld), db);
    }
    if let Some(dx) = dx {
        linear_backward_input(p, (dy, ld), dx);
    }
}

/// The input gradient of [`linear`] alone, dx (β)= dy·W (the last product of
/// [`linear_backward`]), dy in rows `ld` apart; `p.x` is not read.
pub(crate) fn linear_backward_input(
    p: Product<'_>,
    (dy, ld): (&[f32], usize),
    (dx, beta): (&mut [f32], f32),
) {
    let Product { w, t, inp, out, .. } = p;
    gemm(
        1.0,
        Mat::rows(dy, t, out, ld),
        Mat::dense(w, out, inp),
        beta,
        MatMut::dense(dx, t, inp),
    );
}

/// acc += the sum of the rows of `m` (rows of `width` columns, `ld` apart).
pub(crate) fn col_sums(m: &[f32], (width, ld): (usize, usize), acc: &mut [f32]) {
    for row in m.chunks(ld) {
        for (a, &v) in acc.iter_mut().zip(&row[..width]) {
            *a += v;
        }
    }
}
