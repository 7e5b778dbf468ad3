//! Values offloaded to host memory, chunk-major.

use burn::tensor::{DType, Tensor, TensorCreationOptions, TensorData, backend::Backend};

/// One sequence's values in host memory: the raw bytes of `[heads, chunks, chunk, d]` in the
/// model's dtype, so chunk `c` of head `h` is one contiguous run of `chunk · d` elements and a
/// round trip is bit-exact.
#[derive(Debug, Clone)]
pub struct HostValues {
    bytes: Vec<u8>,
    dtype: DType,
    heads: usize,
    chunks: usize,
    chunk: usize,
    d: usize,
}

impl HostValues {
    /// Reads `v` (its first `chunks · chunk` positions) to host memory.
    ///
    /// # Shapes
    /// - `v`: `[heads, ≥ chunks · chunk, d]`
    pub fn from_tensor<B: Backend>(v: Tensor<B, 3>, chunk: usize, chunks: usize) -> Self {
        let [heads, _, d] = v.dims();
        let dtype = v.dtype();
        let v = v.slice([0..heads, 0..chunks * chunk, 0..d]);
        let data = v.into_data();
        Self {
            bytes: data.as_bytes().to_vec(),
            dtype,
            heads,
            chunks,
            chunk,
            d,
        }
    }

    /// Chunks held per head.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// The dtype the bytes are in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn chunk_bytes(&self) -> usize {
        self.chunk * self.d * self.dtype.size()
    }

    /// The bytes of chunk `c` of head `h`.
    ///
    /// # Panics
    /// When `h` or `c` is out of range (internal callers only pass valid ids).
    pub fn chunk_slice(&self, h: usize, c: usize) -> &[u8] {
        assert!(h < self.heads && c < self.chunks, "chunk out of range");
        let n = self.chunk_bytes();
        let start = (h * self.chunks + c) * n;
        &self.bytes[start..start + n]
    }

    /// Uploads the listed chunks, head by head.
    ///
    /// # Shapes
    /// - `sel[h]`: the chunk ids of head `h`, every head the same count `k`
    /// - returns `[heads, k · chunk, d]` in the stored dtype
    pub fn gather<B: Backend>(&self, sel: &[Vec<usize>], device: &B::Device) -> Tensor<B, 3> {
        let k = sel.first().map_or(0, Vec::len);
        let mut staging = RowStager::new(self.chunk_bytes());
        for (h, chunks) in sel.iter().enumerate() {
            for &c in chunks {
                staging.push_row(self.chunk_slice(h, c));
            }
        }
        staging
            .upload(self.chunk * self.d, self.dtype, device)
            .reshape([sel.len(), k * self.chunk, self.d])
    }
}

/// Largest host→device copy [`upload_rows`] issues at once. CubeCL's CUDA runtime stages every
/// upload through pinned host memory from a pool; a fresh multi-hundred-MB staging buffer per
/// layer and step was page-locked anew each time (H100, 2026-11-25: 20.8 s of a 22.5 s decode
/// step at 6.8 GB fetched), while pieces of one fixed size reuse the pool's pages.
pub const UPLOAD_PIECE_BYTES: usize = 32 << 20;

/// Collects rows of raw bytes for upload in pieces of whole rows of at most
/// [`UPLOAD_PIECE_BYTES`], joined on the device by [`RowStager::upload`].
pub(crate) struct RowStager {
    row_bytes: usize,
    per_piece: usize,
    rows: usize,
    pieces: Vec<Vec<u8>>,
}

impl RowStager {
    pub(crate) fn new(row_bytes: usize) -> Self {
        Self::with_piece_bytes(row_bytes, UPLOAD_PIECE_BYTES)
    }

    fn with_piece_bytes(row_bytes: usize, piece_bytes: usize) -> Self {
        Self {
            row_bytes,
            per_piece: (piece_bytes / row_bytes.max(1)).max(1),
            rows: 0,
            pieces: Vec::new(),
        }
    }

    pub(crate) fn push_row(&mut self, row: &[u8]) {
        debug_assert_eq!(row.len(), self.row_bytes);
        if self.rows.is_multiple_of(self.per_piece) {
            self.pieces
                .push(Vec::with_capacity(self.per_piece * self.row_bytes));
        }
        self.pieces
            .last_mut()
            .expect("a piece")
            .extend_from_slice(row);
        self.rows += 1;
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// The staged rows as a `[rows, row_len]` tensor of `dtype` (`rows ≥ 1`).
    pub(crate) fn upload<B: Backend>(
        self,
        row_len: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Tensor<B, 2> {
        let row_bytes = self.row_bytes;
        let mut pieces: Vec<Tensor<B, 2>> = self
            .pieces
            .into_iter()
            .map(|p| {
                let n = p.len() / row_bytes;
                upload(p, [n, row_len], dtype, device)
            })
            .collect();
        if pieces.len() == 1 {
            pieces.pop().expect("one piece")
        } else {
            Tensor::cat(pieces, 0)
        }
    }
}

/// Uploads raw bytes of `dtype` as a tensor.
pub(crate) fn upload<B: Backend, const D: usize>(
    bytes: Vec<u8>,
    shape: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(
        TensorData::from_bytes_vec(bytes, shape, dtype),
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    /// Rows staged in several pieces (and a ragged last one) upload to the same tensor as in one.
    #[test]
    fn pieces_join_in_order() {
        let device = Default::default();
        let (rows, row_len) = (11, 3);
        let values: Vec<f32> = (0..rows * row_len).map(|i| i as f32 * 0.5 - 7.0).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let row_bytes = row_len * 4;
        for piece_bytes in [1, row_bytes, 4 * row_bytes + 5, 1 << 20] {
            let mut st = RowStager::with_piece_bytes(row_bytes, piece_bytes);
            for r in bytes.chunks(row_bytes) {
                st.push_row(r);
            }
            assert_eq!(st.rows(), rows);
            let t = st.upload::<NdArray>(row_len, DType::F32, &device);
            assert_eq!(t.dims(), [rows, row_len]);
            let got = t.into_data().to_vec::<f32>().unwrap();
            assert_eq!(got, values, "piece of {piece_bytes} bytes");
        }
    }
}
