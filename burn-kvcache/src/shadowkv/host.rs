//! Values offloaded to host memory, chunk-major.

use burn::tensor::{DType, Device, StreamId, Tensor, TensorCreationOptions, TensorData};
use cubecl::bytes::{AccessError, AccessPolicy, AllocationController, AllocationProperty, Bytes};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

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
    pub fn from_tensor(v: Tensor<3>, chunk: usize, chunks: usize) -> Self {
        let [heads, _, d] = v.dims();
        let dtype = v.dtype();
        let v = v.slice([0..heads, 0..chunks * chunk, 0..d]);
        let data = v.into_data();
        Self {
            bytes: huge_page_copy(data.as_bytes(), huge_pages_wanted()),
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
    pub fn gather(&self, sel: &[Vec<usize>], device: &Device) -> Tensor<3> {
        self.gather_in(sel, device, true)
    }

    /// [`HostValues::gather`], through pinned host memory only when `pinned`.
    pub(crate) fn gather_in(&self, sel: &[Vec<usize>], device: &Device, pinned: bool) -> Tensor<3> {
        let k = sel.first().map_or(0, Vec::len);
        let rows: Vec<&[u8]> = sel
            .iter()
            .enumerate()
            .flat_map(|(h, chunks)| chunks.iter().map(move |&c| self.chunk_slice(h, c)))
            .collect();
        upload_rows(&rows, self.chunk * self.d, self.dtype, device, pinned).reshape([
            sel.len(),
            k * self.chunk,
            self.d,
        ])
    }
}

/// `bytes` copied into a new buffer, whose 2 MB-aligned extents the kernel is asked to back with
/// transparent huge pages (before any page is touched) where `huge`.
///
/// Why it exists: a decode step gathers thousands of 2 KB chunks at random from tens of GB of values (at
/// 128K, batch 10: 21 504 a layer from 88 GB). With 4 KB pages each chunk costs a TLB miss whose
/// page walk itself misses the caches (88 GB of 4 KB pages is 176 MB of page tables); a 2 MB page
/// covers a thousand chunks. Gathering 44 MB of random 2 KB rows from 6 GB took 15.4 ms with
/// 4 KB pages and 9.3 ms with huge pages on this project's 2-core build machine (2026-12-07).
/// Why it is off by default: on an H100 host (16 cores) the decode step at 128K, batch 10, took
/// 212.1 ms with huge pages and 204.4 ms without, the same machine one after the other
/// (2026-12-07, `bench/results/2026-12-07/nvidia-h100-s64.md`): the build machine's gain did not
/// carry over. It is advice: where the kernel has no transparent huge pages (or they are off),
/// the buffer is an ordinary one.
fn huge_page_copy(bytes: &[u8], huge: bool) -> Vec<u8> {
    let mut out: Vec<u8> = Vec::with_capacity(bytes.len());
    if huge {
        advise_huge_pages(out.as_mut_ptr(), out.capacity());
    }
    out.extend_from_slice(bytes);
    out
}

/// Whether host values ask for huge pages ([`huge_page_copy`]): only with
/// `BURN_KERNELS_SHADOWKV_HUGEPAGES=1` (read once).
fn huge_pages_wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("BURN_KERNELS_SHADOWKV_HUGEPAGES").is_ok_and(|v| v == "1"))
}

/// Asks the kernel to back the whole 2 MB extents of `len` bytes from `ptr` with transparent
/// huge pages; whether it took the advice (false off Linux and for buffers under 4 MB).
fn advise_huge_pages(ptr: *mut u8, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize).saturating_add(len) / HUGE * HUGE;
        if end > start {
            // SAFETY: `madvise` with MADV_HUGEPAGE only changes how the kernel backs pages of
            // this process's own allocation (the range lies inside it); contents are unchanged.
            let ok = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
            } == 0;
            static LOGGED: OnceLock<()> = OnceLock::new();
            LOGGED.get_or_init(|| log::info!("ShadowKV: host values on huge pages: {ok}"));
            return ok;
        }
        false
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, len);
        false
    }
}

/// Largest host buffer [`upload_rows`] hands to the runtime at once. CubeCL 0.10 copies every
/// upload into a fresh vector before a pageable copy: pieces of a few MB stay below glibc's
/// mmap threshold (≤ 32 MB), so the allocator reuses resident pages instead of mapping and
/// faulting in fresh ones for every layer and step (H100, 2026-11-25: 20.8 s of a 22.5 s
/// decode step went to 6.8 GB fetched in one buffer).
pub const UPLOAD_PIECE_BYTES: usize = 8 << 20;

/// Keeps glibc's allocator from handing freed upload buffers back to the OS between layers.
///
/// Each decode step allocates and frees a few MB-sized host buffers per layer (the gathered
/// pieces, and the runtime's copy of each). By default glibc serves blocks above a moving
/// threshold with fresh `mmap`s and trims the heap's top past another, so every step faults
/// those pages in again (~0.5 µs per 4 KB page, zeroed by the kernel). This fixes the mmap
/// threshold at glibc's maximum (32 MB, above `UPLOAD_PIECE_BYTES`) and the trim threshold at
/// 2 GB, once per process (the settings are process-wide; [`crate::ShadowKvCache::new`] calls
/// it). Returns whether both settings were taken; elsewhere than glibc it does nothing.
pub fn tune_host_allocator() -> bool {
    static TUNED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TUNED.get_or_init(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: `mallopt` only sets allocator parameters; glibc takes its own locks.
            let ok = unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                    && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
            };
            log::info!("ShadowKV: glibc mmap threshold 32 MB, trim threshold 2 GB: {ok}");
            ok
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        {
            false
        }
    })
}

/// Rows one gather task copies.
const ROWS_PER_TASK: usize = 64;

/// Copies `rows` (each `row_bytes` long) into one buffer, on every core.
///
/// # Panics
/// When a row is not `row_bytes` long.
fn gather_piece(rows: &[&[u8]], row_bytes: usize) -> Vec<u8> {
    let n = rows.len() * row_bytes;
    let mut out: Vec<u8> = Vec::with_capacity(n);
    fill_rows(&mut out.spare_capacity_mut()[..n], rows, row_bytes);
    // SAFETY: `fill_rows` wrote all `n` bytes (it checks that the rows cover them).
    unsafe { out.set_len(n) };
    out
}

/// Writes `rows` (each `row_bytes` long) one after another into `dst`, on every core.
///
/// # Panics
/// When a row is not `row_bytes` long, or the rows do not cover `dst` exactly.
fn fill_rows(dst: &mut [MaybeUninit<u8>], rows: &[&[u8]], row_bytes: usize) {
    assert!(
        row_bytes > 0 && rows.iter().all(|r| r.len() == row_bytes),
        "rows of {row_bytes} bytes"
    );
    assert_eq!(dst.len(), rows.len() * row_bytes, "rows cover the buffer");
    dst.par_chunks_mut(ROWS_PER_TASK * row_bytes)
        .zip(rows.par_chunks(ROWS_PER_TASK))
        .for_each(|(dst, src)| {
            for (d, s) in dst.chunks_mut(row_bytes).zip(src) {
                for (d, &s) in d.iter_mut().zip(s.iter()) {
                    d.write(s);
                }
            }
        });
}

/// Bytes not yet filled, handed to [`Device::staging`] to obtain pinned host memory of their
/// size without copying anything into it: the staging copies a source with
/// [`AllocationController::copy_into`], which here copies nothing while no byte has been
/// asked for, and the caller then writes every byte of the pinned buffer it gets back. Where
/// the device keeps these bytes (no pinned staging: wgpu, the CPU), the first access
/// allocates them, zeroed, and the caller fills them the same way.
struct Unfilled {
    len: usize,
    memory: OnceLock<Box<[MaybeUninit<u8>]>>,
}

impl Unfilled {
    /// `len` unfilled bytes.
    fn bytes(len: usize) -> Bytes {
        let controller = Box::new(Unfilled {
            len,
            memory: OnceLock::new(),
        });
        // SAFETY: every access to the `len` bytes goes through `memory`/`memory_mut`, which
        // allocate them initialized (zeroed); `copy_into` before that copies nothing, which
        // its callers here (`Device::staging`) follow by writing the whole destination.
        unsafe { Bytes::from_controller(controller, len) }
    }

    fn zeroed(len: usize) -> Box<[MaybeUninit<u8>]> {
        vec![MaybeUninit::new(0u8); len].into_boxed_slice()
    }
}

impl AllocationController for Unfilled {
    fn alloc_align(&self) -> usize {
        1
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Native
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        let len = self.len;
        self.memory.get_or_init(|| Self::zeroed(len));
        Ok(self.memory.get_mut().expect("initialized above"))
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        Ok(self.memory.get_or_init(|| Self::zeroed(self.len)))
    }

    fn capacity(&self) -> usize {
        self.len
    }

    unsafe fn copy_into(&self, buf: &mut [u8]) {
        if let Some(memory) = self.memory.get() {
            // SAFETY: `memory` was allocated initialized and `buf` is at most `len` long
            // (`Bytes::copy_into` passes its own length).
            let memory =
                unsafe { &*(&memory[..buf.len()] as *const [MaybeUninit<u8>] as *const [u8]) };
            buf.copy_from_slice(memory);
        }
    }
}

/// Uploads `rows` of raw bytes as a `[rows, row_len]` tensor of `dtype` (`rows ≥ 1`),
/// gathered into pieces of whole rows of at most [`UPLOAD_PIECE_BYTES`] (each piece on its
/// own core, and moved into pinned host memory there when `pinned`, see
/// [`super::ShadowKvConfig::pinned_uploads`]) joined on the device.
pub(crate) fn upload_rows(
    rows: &[&[u8]],
    row_len: usize,
    dtype: DType,
    device: &Device,
    pinned: bool,
) -> Tensor<2> {
    let copies = (pinned, pinned && overlap_copies());
    upload_rows_in(rows, row_len, dtype, device, UPLOAD_PIECE_BYTES, copies)
}

fn upload_rows_in(
    rows: &[&[u8]],
    row_len: usize,
    dtype: DType,
    device: &Device,
    piece_bytes: usize,
    (pinned, overlap): (bool, bool),
) -> Tensor<2> {
    let row_bytes = row_len * dtype.size();
    let per_piece = (piece_bytes / row_bytes.max(1)).max(1);
    let piece = |p: &[&[u8]]| {
        TensorData::from_bytes_vec(gather_piece(p, row_bytes), [p.len(), row_len], dtype)
    };
    let upload = |data: TensorData| Tensor::<2>::from_data(data, options(dtype, device));
    let mut pieces: Vec<Tensor<2>> = if pinned {
        // Every piece staged and gathered on its own core: staging reserves pinned memory from
        // the calling stream's pool (so each task runs on the caller's stream) without copying
        // into it (`Unfilled`), and the rows are gathered straight into it: one host copy.
        let stream = StreamId::current();
        let stage = |p: &[&[u8]]| {
            let len = p.len() * row_bytes;
            let mut data = TensorData::from_bytes(Unfilled::bytes(len), [p.len(), row_len], dtype);
            stream.executes(|| device.staging(std::iter::once(&mut data)));
            TensorData::with_bytes_mut(std::iter::once(&mut data), |mut bytes| {
                let dst: &mut [u8] = bytes[0];
                // SAFETY: the same memory seen as possibly uninitialized; `fill_rows` only
                // writes initialized bytes into it.
                let dst = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
                fill_rows(dst, p, row_bytes);
            });
            data
        };
        if overlap {
            // Each task issues its piece's copy (on the caller's stream) as soon as it is
            // gathered: the copies run while the other pieces are still being gathered.
            rows.par_chunks(per_piece)
                .map(|p| {
                    let data = stage(p);
                    stream.executes(|| upload(data))
                })
                .collect()
        } else {
            let staged: Vec<TensorData> = rows.par_chunks(per_piece).map(stage).collect();
            staged.into_iter().map(upload).collect()
        }
    } else {
        // One piece after another (each gathered on every core), the runtime copying each
        // into its own staging buffer while the next is gathered.
        rows.chunks(per_piece).map(|p| upload(piece(p))).collect()
    };
    if pieces.len() == 1 {
        pieces.pop().expect("one piece")
    } else {
        Tensor::cat(pieces, 0)
    }
}

/// Whether each pinned piece's copy is issued by the task that gathered it, as soon as it is
/// gathered (`BURN_KERNELS_SHADOWKV_OVERLAP=1`), rather than all copies after every piece is
/// gathered (the default, measured at 80–97 ms a step at 128K on H100s, 2026-12-07). Read once
/// a process; an experiment until both have run on one machine (device step `skv128o`).
fn overlap_copies() -> bool {
    static OVERLAP: OnceLock<bool> = OnceLock::new();
    *OVERLAP.get_or_init(|| std::env::var("BURN_KERNELS_SHADOWKV_OVERLAP").is_ok_and(|v| v == "1"))
}

fn options(dtype: DType, device: &Device) -> TensorCreationOptions {
    TensorCreationOptions::new(device.clone()).with_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy holds the same bytes, with huge pages asked for and not, at sizes with and
    /// without whole 2 MB extents.
    #[test]
    fn huge_page_copy_is_exact() {
        for len in [0, 1, 4095, (5 << 20) + 123] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            for huge in [true, false] {
                assert_eq!(huge_page_copy(&bytes, huge), bytes, "{len} bytes, {huge}");
            }
        }
    }

    /// Rows gathered in several pieces (and a ragged last one) upload to the same tensor as
    /// in one, in order, whichever way the pieces are staged and copied.
    #[test]
    fn pieces_join_in_order() {
        let device = Default::default();
        let (rows, row_len) = (300, 3);
        let values: Vec<f32> = (0..rows * row_len).map(|i| i as f32 * 0.5 - 7.0).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let row_bytes = row_len * 4;
        // Rows in reverse: the gather follows the list, not memory order.
        let refs: Vec<&[u8]> = bytes.chunks(row_bytes).rev().collect();
        let values: Vec<f32> = values.chunks(row_len).rev().flatten().copied().collect();
        for piece_bytes in [1, row_bytes, 4 * row_bytes + 5, 70 * row_bytes, 1 << 20] {
            for copies in [(false, false), (true, false), (true, true)] {
                let t = upload_rows_in(&refs, row_len, DType::F32, &device, piece_bytes, copies);
                assert_eq!(t.dims(), [rows, row_len]);
                let got = t.into_data().try_to_vec::<f32>().unwrap();
                assert_eq!(
                    got, values,
                    "piece of {piece_bytes} bytes, (pinned, overlap) {copies:?}"
                );
            }
        }
    }
}
