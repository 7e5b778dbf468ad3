//! Host-side preparation of loaded weights for the device: projections transposed to the
//! model's `[in, out]` layout and every tensor converted to the model's dtype, on all cores.
//!
//! A cold `llama generate` spends its first second here and in the GGUF decode (SmolLM2-135M:
//! 135 M values, 106 M of them in projections to transpose), so the work is cut per tensor and
//! the transposes walk 64 × 64 tiles instead of scattering one column at a time.

use super::HostTensor;
use burn::tensor::{DType, TensorData};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Edge of the square tiles the transpose copies.
const TILE: usize = 64;

/// `[rows, cols]` row-major → `[cols, rows]` row-major.
pub fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(
        data.len(),
        rows * cols,
        "transpose: data is not rows × cols"
    );
    let mut out = vec![0f32; data.len()];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    out[c * rows + r] = data[r * cols + c];
                }
            }
        }
    }
    out
}

/// Each `(tensor, transpose)` as `TensorData` of `dtype`: 1-D tensors as they are, 2-D ones
/// `[rows, cols]` (or `[cols, rows]` when `transpose`). Jobs run on every available core,
/// largest first; the result keeps the jobs' order.
pub fn prepare(jobs: &[(&HostTensor, bool)], dtype: DType) -> Vec<TensorData> {
    let one = |(t, flip): &(&HostTensor, bool)| -> TensorData {
        if t.shape.len() == 1 {
            return TensorData::new(t.data.clone(), [t.data.len()]).convert_dtype(dtype);
        }
        let (rows, cols) = (t.shape[0], t.shape.get(1).copied().unwrap_or(1));
        let data = if *flip {
            TensorData::new(transpose(&t.data, rows, cols), [cols, rows])
        } else {
            TensorData::new(t.data.clone(), [rows, cols])
        };
        data.convert_dtype(dtype)
    };
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].0.data.len()));
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, TensorData)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let at = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = order.get(at) else { break };
                        mine.push((i, one(&jobs[i])));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a weight-preparation thread panicked"))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, d)| d).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_matches_the_definition_on_ragged_tiles() {
        for (rows, cols) in [(1, 1), (1, 7), (131, 67), (64, 129)] {
            let data: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
            let out = transpose(&data, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        out[c * rows + r],
                        data[r * cols + c],
                        "{rows}x{cols} at {r},{c}"
                    );
                }
            }
        }
    }

    #[test]
    fn prepare_keeps_the_jobs_order_shapes_and_dtype() {
        let t = |shape: Vec<usize>, seed: f32| HostTensor {
            data: (0..shape.iter().product::<usize>())
                .map(|i| (i as f32 * 0.37 + seed).sin())
                .collect(),
            shape,
        };
        let (a, b, c) = (t(vec![3, 5], 1.0), t(vec![7], 2.0), t(vec![130, 70], 3.0));
        let jobs = [(&a, true), (&b, false), (&c, false), (&a, false)];
        let out = prepare(&jobs, DType::BF16);
        let shapes: Vec<Vec<usize>> = out.iter().map(|d| d.shape().to_vec()).collect();
        assert_eq!(shapes, [vec![5, 3], vec![7], vec![130, 70], vec![3, 5]]);
        assert!(out.iter().all(|d| d.dtype() == DType::BF16));
        let back =
            |d: &TensorData| -> Vec<f32> { d.clone().convert::<f32>().try_to_vec().unwrap() };
        let want = transpose(&a.data, 3, 5);
        for (got, want) in back(&out[0]).iter().zip(&want) {
            assert_eq!(*got, half::bf16::from_f32(*want).to_f32());
        }
        assert_eq!(back(&out[2]).len(), 130 * 70);
        assert_eq!(back(&out[3])[4], half::bf16::from_f32(a.data[4]).to_f32());
    }
}
