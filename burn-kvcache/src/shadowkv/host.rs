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
        let mut staging = Vec::with_capacity(self.heads * k * self.chunk_bytes());
        for (h, chunks) in sel.iter().enumerate() {
            for &c in chunks {
                staging.extend_from_slice(self.chunk_slice(h, c));
            }
        }
        upload(
            staging,
            [sel.len(), k * self.chunk, self.d],
            self.dtype,
            device,
        )
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
