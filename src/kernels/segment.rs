//! The one layout type of the flat parameter buffer: where each parameter lies, and its shape as a matrix.
//! The optimizers and their kernels, the compressed reducers, gossip's codecs and DiLoCo's outer step all
//! read it; `model::params::ParamSet::segments` hands it out for a model, and `Segment::of_shapes` lays out
//! named shapes the same way without one (`check`, `predict`, the memory estimate).

/// One parameter in the flat buffer, viewed as a `rows x cols` matrix (rows = its first dimension; a
/// vector is `1 x len`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Segment {
    pub offset: usize,
    pub len: usize,
    pub rows: usize,
    pub cols: usize,
    /// Rank >= 2: nanoGPT's weight-decay group, and what the compressors compress (vectors, i.e. biases
    /// and LayerNorm, go dense).
    pub matrix: bool,
}

impl Segment {
    /// A `1 x len` segment at `offset` (a part of a parameter, or a flat buffer of its own).
    pub fn flat(offset: usize, len: usize, matrix: bool) -> Self {
        Self {
            offset,
            len,
            rows: 1,
            cols: len,
            matrix,
        }
    }

    /// Whether weight decay applies to this parameter (nanoGPT's groups: matrices and embeddings).
    pub fn decays(&self) -> bool {
        self.matrix
    }

    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }

    /// The flat layout of named parameters: sorted by name, as `ParamSet` lays them out.
    pub fn of_shapes(named: impl IntoIterator<Item = (String, Vec<usize>)>) -> Vec<Self> {
        let mut named: Vec<_> = named.into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut offset = 0;
        named
            .into_iter()
            .map(|(_, shape)| {
                let len = shape.iter().product::<usize>();
                let rows = shape.first().copied().unwrap_or(1);
                let s = Self {
                    offset,
                    len,
                    rows,
                    cols: len / rows.max(1),
                    matrix: shape.len() >= 2,
                };
                offset += len;
                s
            })
            .collect()
    }

    /// Consecutive segments of the given (rows, cols, is a matrix) shapes.
    pub fn from_shapes(shapes: &[(usize, usize, bool)]) -> Vec<Self> {
        let mut offset = 0;
        shapes
            .iter()
            .map(|&(rows, cols, matrix)| {
                offset += rows * cols;
                Self {
                    offset: offset - rows * cols,
                    len: rows * cols,
                    rows,
                    cols,
                    matrix,
                }
            })
            .collect()
    }

    /// Flat segments of the given (length, is a matrix) laid end to end from offset 0.
    pub fn end_to_end(parts: impl IntoIterator<Item = (usize, bool)>) -> Vec<Self> {
        let mut offset = 0;
        parts
            .into_iter()
            .map(|(len, matrix)| {
                offset += len;
                Self::flat(offset - len, len, matrix)
            })
            .collect()
    }

    /// The parts of `segments` inside `range` as flat segments, their offsets counted from its start (the
    /// segments of a shard, see `Optimizer::step_shard`; a part keeps its parameter's weight-decay group).
    pub fn cut(segments: &[Segment], range: std::ops::Range<usize>) -> Vec<Segment> {
        segments
            .iter()
            .filter_map(|s| {
                let (start, end) = (s.offset.max(range.start), (s.offset + s.len).min(range.end));
                (start < end).then(|| Self::flat(start - range.start, end - start, s.matrix))
            })
            .collect()
    }
}
