//! Where each parameter lies in a flat buffer: the layout the optimizers and their kernels step over.

/// A parameter's range in the flat buffer and whether weight decay applies to it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Segment {
    pub offset: usize,
    pub len: usize,
    pub decay: bool,
}

impl Segment {
    /// The parts of `segments` inside `range`, their offsets counted from its start (the segments of a
    /// shard, see `Optimizer::step_shard`).
    pub fn cut(segments: &[Segment], range: std::ops::Range<usize>) -> Vec<Segment> {
        segments
            .iter()
            .filter_map(|s| {
                let (start, end) = (s.offset.max(range.start), (s.offset + s.len).min(range.end));
                (start < end).then(|| Segment {
                    offset: start - range.start,
                    len: end - start,
                    decay: s.decay,
                })
            })
            .collect()
    }

    /// Segments of the given (length, decay) laid end to end from offset 0.
    pub fn end_to_end(parts: impl IntoIterator<Item = (usize, bool)>) -> Vec<Segment> {
        let mut offset = 0;
        parts
            .into_iter()
            .map(|(len, decay)| {
                offset += len;
                Segment {
                    offset: offset - len,
                    len,
                    decay,
                }
            })
            .collect()
    }
}
