//! Block sizes of the chunked backward ([`crate::chunked::backward`]): vocabulary chunks, how dE
//! is accumulated, and the row blocks of its f32 accumulator.

use burn::tensor::DType;
use std::ops::Range;

use crate::{DeCarry, LceParams};

/// How the backward accumulates dE; see [`BackwardBlocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeAccumulation {
    /// In dE itself, in its dtype (`accum_fp32` off, or f32 inputs): per chunk, the f32
    /// products `G[rows]·C_chunk` are added in place and rounded once.
    Direct,
    /// In one f32 accumulator for all of dE (`N·D·4` bytes), rounded to dE's dtype at the end.
    Whole,
    /// In a second pass over the kept vocabulary, one block of `rows` rows at a time, each
    /// block's f32 accumulator rounded into dE once: one more logits GEMM over the kept
    /// entries, but only `rows·D·4` bytes of accumulator.
    RowBlocks,
    /// In dE itself plus an i8 correction per value (`N·D` bytes, [`crate::DeCarry::Compensated`]),
    /// both updated in the vocabulary pass as the Hopper GEMM stores each chunk's product
    /// `G · C_chunk`: no second pass, no f32 accumulator.
    Compensated,
}

/// Share of the gradients' bytes (`dE + dC`) that the compensated carry's corrections and its
/// chunk's working set may take: the goal is a peak within 1.05× of `dE + dC`.
const COMPENSATED_SHARE: f64 = 0.048;
/// Narrowest chunk that [`BackwardBlocks::filled`] narrows the compensated carry's chunk to
/// (a chunk the memory makes narrower stays as it is): each chunk's product reads and writes
/// dE and its corrections once (`6·N·D` bytes, 113 MB at Gemma-2's shape), so narrower chunks
/// spend more of their time moving them than multiplying.
const MIN_COMPENSATED_CHUNK: usize = 1024;

/// Block sizes of the chunked backward for `n` tokens, `V` entries, hidden size `D` and input
/// dtype size `s` (bytes).
///
/// The vocabulary pass walks the plan in chunks of `chunk` entries over all `n` rows, holding
/// one chunk's `G` in the input dtype (`s·n·chunk`), its gathered classifier rows (`s·chunk·D`)
/// and, unless the Hopper GEMM writes `G` itself ([`BackwardBlocks::in_gemm`]), its f32 logits
/// (`4·n·chunk`): `S = (4 + s)·n·chunk + s·chunk·D`, or `s·n·chunk + s·chunk·D` in the GEMM.
/// dE's f32 blocks are sized to stay within `S`: products of `rows` rows no larger than the
/// logits (in the GEMM: `G`), and with [`DeAccumulation::RowBlocks`] a second pass over chunks
/// of `pass2_chunk` entries (the kept chunks regrouped, about `D` entries, for GEMMs that are
/// neither narrow nor deep) with `rows` such that accumulator, `G`, classifier rows and (stored
/// logits) the logits or product fit `S`. [`BackwardBlocks::working_bytes`] is the resulting
/// peak beside dE and dC. With [`DeAccumulation::Compensated`] there is no second pass and no
/// f32 block: the working set is dE's i8 corrections (`N·D` bytes) beside the vocabulary
/// pass's, whose chunks are sized to fit both ([`BackwardBlocks::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardBlocks {
    /// Vocabulary entries per chunk of the plan (see [`crate::LceParams::grad_chunk_len`]).
    pub chunk: usize,
    /// How dE is accumulated.
    pub de: DeAccumulation,
    /// Rows per f32 block: of each product `G[rows]·C_chunk` ([`DeAccumulation::Direct`],
    /// [`DeAccumulation::Whole`]), or of each accumulator block
    /// ([`DeAccumulation::RowBlocks`]).
    pub rows: usize,
    /// Entries per chunk of the second pass ([`DeAccumulation::RowBlocks`]).
    pub pass2_chunk: usize,
    /// Whether `G` is written by core's Hopper GEMM from the logits in registers
    /// (`burn_kernels_core::gemm::hopper::hopper_grad`) and the second pass's dE products are
    /// added into its f32 accumulator blocks by that GEMM (`hopper_gemm_add`): no chunk's f32
    /// logits and no f32 product of that pass are stored, so the chunks are wider at the same
    /// memory.
    pub in_gemm: bool,
    /// Whether the plan's chunks are gathered (filtered and sorted by score): their classifier
    /// rows are copies. Natural chunks' rows are views of `C`, which hold no memory.
    pub gathered: bool,
}

/// Splits `n` rows into equal blocks of at most `max` rows, a multiple of 32 where that stays
/// within `max` (full GEMM tiles).
fn balanced_rows(n: usize, max: usize) -> usize {
    let n = n.max(1);
    let max = max.clamp(1, n);
    let even = n.div_ceil(n.div_ceil(max));
    let aligned = even.next_multiple_of(32);
    if aligned <= max { aligned } else { even }
}

pub(crate) fn row_ranges(n: usize, rows: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n)
        .step_by(rows.max(1))
        .map(move |r0| r0..(r0 + rows.max(1)).min(n))
}

impl BackwardBlocks {
    /// The blocks for `n` tokens, `vocab` entries, hidden size `d` and inputs of `dtype`.
    ///
    /// At the benchmark shapes (8192 tokens, bf16, automatic sizes, natural chunks, dE carried
    /// in f32):
    /// - Gemma-2 (V = 256000, D = 2304): chunks of 672 entries; dE in a second pass over 7
    ///   blocks of 1184 rows and chunks of 2016 entries; working set 33 030 144 bytes, 2.71% of
    ///   dE + dC (1 217 396 736 bytes): peak 1 250 426 880 bytes, 1.027×.
    /// - SmolLM2 (V = 49152, D = 576): chunks of 256 entries (the 2²¹-logit floor); second pass
    ///   over 4 blocks of 2048 rows and chunks of 512 entries; working set 12 582 912 bytes,
    ///   19.0% of dE + dC (66 060 288 bytes): peak 78 643 200 bytes, 1.190×.
    /// - Gemma-2 with `G` in the Hopper GEMM ([`BackwardBlocks::in_gemm`]), the f32 carry:
    ///   chunks of 1728 entries, a second pass over 4 blocks of 2048 rows and chunks of 1728
    ///   entries (before [`BackwardBlocks::filled`]); working set 36 274 176 bytes, 2.98%:
    ///   peak 1.030×. With [`DeCarry::Compensated`] (and the default, [`DeCarry::Auto`]): dE
    ///   carried in the vocabulary pass
    ///   ([`DeAccumulation::Compensated`]) in chunks of 1856 entries; working set 57 835 520
    ///   bytes (18 874 368 of corrections, then `G` and the chunk's dC rows), 4.75%: peak 1.048×.
    ///
    /// The compensated carry ([`DeCarry::Compensated`]) takes the largest chunk, a multiple of
    /// 32, whose working set with the corrections is 4.8% of `dE + dC` (or the chunk of
    /// `chunk_bytes`). [`DeCarry::Auto`] takes it where the f32 carry would need a second pass
    /// and that chunk is at least [`MIN_COMPENSATED_CHUNK`] entries (or the whole vocabulary):
    /// Gemma-2's shape, not SmolLM2's (see its docs for the measurements).
    pub fn new(
        params: &LceParams,
        n: usize,
        vocab: usize,
        d: usize,
        dtype: DType,
        in_gemm: bool,
    ) -> Self {
        let f32_blocks = Self::f32_carry(params, n, vocab, d, dtype, in_gemm);
        let usable = in_gemm && dtype == DType::BF16 && params.accum_fp32;
        if params.de_carry == DeCarry::F32 || !usable || params.de_block_rows.is_some() {
            return f32_blocks;
        }
        let chunk = Self::compensated_chunk(params, n, vocab, d, dtype, f32_blocks.gathered);
        // `Auto` carries compensated where the f32 carry would take a second pass and the
        // corrections leave chunks of a useful width (see `DeCarry::Auto`).
        let worth =
            f32_blocks.de == DeAccumulation::RowBlocks && chunk >= MIN_COMPENSATED_CHUNK.min(vocab);
        if params.de_carry == DeCarry::Auto && !worth {
            return f32_blocks;
        }
        Self {
            chunk,
            de: DeAccumulation::Compensated,
            rows: n.max(1),
            pass2_chunk: chunk,
            ..f32_blocks
        }
    }

    /// The compensated carry's chunk: from `chunk_bytes` where set, else the widest (a
    /// multiple of 32, at least 32, at most `vocab`) whose corrections (`n·d` bytes), `G`, dC
    /// rows and gathered classifier rows take [`COMPENSATED_SHARE`] of `dE + dC`.
    fn compensated_chunk(
        params: &LceParams,
        n: usize,
        vocab: usize,
        d: usize,
        dtype: DType,
        gathered: bool,
    ) -> usize {
        if params.chunk_bytes.is_some() {
            return params.grad_chunk_len(n, vocab, d, dtype, true);
        }
        let (n, s) = (n.max(1), dtype.size());
        let bound = s * (n + vocab) * d;
        let budget = (COMPENSATED_SHARE * bound as f64) as usize;
        let per_entry = s * n + s * d * (1 + gathered as usize);
        let fit = budget.saturating_sub(n * d) / per_entry.max(1) / 32 * 32;
        fit.max(32).min(vocab.max(1))
    }

    /// The blocks of an f32 carry ([`DeCarry::F32`]), and of the other accumulations.
    fn f32_carry(
        params: &LceParams,
        n: usize,
        vocab: usize,
        d: usize,
        dtype: DType,
        in_gemm: bool,
    ) -> Self {
        let s = dtype.size();
        let chunk = params.grad_chunk_len(n, vocab, d, dtype, in_gemm);
        let rows_n = n.max(1);
        // The chunk's largest block: its f32 logits, or in the GEMM its `G`.
        let block = if in_gemm { s } else { 4 } * rows_n * chunk;
        // Products no larger than that block, which is freed by then.
        let product_rows = balanced_rows(rows_n, block / (4 * d.max(1)));
        let blocks = |de, rows, pass2_chunk| Self {
            chunk,
            de,
            rows,
            pass2_chunk,
            in_gemm,
            gathered: params.filter_eps.is_some() && params.sort_vocab,
        };
        if !params.accum_fp32 || s >= 4 {
            let rows = params
                .de_block_rows
                .map_or(product_rows, |r| r.clamp(1, rows_n));
            return blocks(DeAccumulation::Direct, rows, chunk);
        }
        let whole = blocks(DeAccumulation::Whole, product_rows, chunk);
        let pass1 = Self::pass1_bytes(rows_n, chunk, d, s, in_gemm);
        let fit = |c2: usize| {
            // Accumulator and `G` rows, and the stored logits or product.
            let stored = if in_gemm { 0 } else { 4 * c2.max(d) };
            let per_row = 4 * d + s * c2 + stored;
            pass1.saturating_sub(s * c2 * d) / per_row
        };
        // Second-pass chunks of about D entries: the logits GEMM [rows, c2] and the product
        // GEMM [rows, D] then have about as many output tiles.
        let widest = ((d as f64 / chunk as f64).round() as usize).max(1);
        match params.de_block_rows {
            Some(r) if r >= n => whole,
            Some(r) => {
                let k = (1..=widest)
                    .rev()
                    .find(|&k| fit(chunk * k) >= r)
                    .unwrap_or(1);
                blocks(DeAccumulation::RowBlocks, r.max(1), chunk * k)
            }
            None if 4 * rows_n * d <= block => whole,
            None => {
                let min_rows = rows_n.min(32);
                let k = (1..=widest)
                    .rev()
                    .find(|&k| fit(chunk * k) >= min_rows)
                    .unwrap_or(1);
                let rows = balanced_rows(rows_n, fit(chunk * k).max(min_rows));
                if rows >= rows_n {
                    whole
                } else {
                    blocks(DeAccumulation::RowBlocks, rows, chunk * k)
                }
            }
        }
    }

    /// These blocks with dE's second pass shaped for a device of `sms` multiprocessors, where
    /// `G` is written in the Hopper GEMM ([`DeAccumulation::RowBlocks`] and
    /// [`BackwardBlocks::in_gemm`]; otherwise unchanged), within the same working set
    /// ([`BackwardBlocks::working_bytes`] for `dtype`):
    /// - row blocks: of up to 4 more blocks than the memory allows, the count whose two GEMMs
    ///   per chunk (`G`: `[rows, pass2_chunk]` over K = `d`; the product: `[rows, d]` over K =
    ///   `pass2_chunk`) take the fewest waves of the kernel's 128-row tiles, weighted by a
    ///   wave's work;
    /// - second-pass chunks: the widest multiple of `chunk` (up to 16) that fits: each chunk's
    ///   product reads and writes the block's f32 accumulator once, so fewer, longer products
    ///   move less memory and launch less.
    ///
    /// At the Gemma-2 shape on an H100 (132 SMs): 5 blocks of 1664 rows (13 row tiles, 117
    /// tiles per product: one wave) instead of 4 of 2048 (144 tiles: two waves, the second of
    /// 12 tiles); second-pass chunks of 5184 entries (natural chunks, the exact default) or 3456
    /// (gathered), instead of 1728.
    ///
    /// With [`DeAccumulation::Compensated`], the vocabulary pass's chunk instead: of the
    /// multiples of 64 from 1024 up to the memory's chunk, the one whose three GEMMs per chunk
    /// (`G`: `[n, chunk]`; dC: `[chunk, d]` over K = `n`; the compensated product `[n, d]` over
    /// K = `chunk`, its epilogue counted as 512 more of K) take the fewest waves per entry. At
    /// Gemma-2's shape on 132 SMs: 1792 entries instead of 1856, so that dC's `[chunk, 2304]`
    /// takes 126 tiles (one wave) rather than 135 (two), and `G` 256-column tiles (1856 takes
    /// 64: the narrowest tile without padding).
    pub fn filled(self, n: usize, d: usize, dtype: DType, sms: usize) -> Self {
        use burn_kernels_core::gemm::hopper::{BM, tile_width};
        if self.de == DeAccumulation::Compensated && sms > 0 && n > 0 {
            return self.waved_chunk(n, d, sms);
        }
        if self.de != DeAccumulation::RowBlocks || !self.in_gemm || sms == 0 || n == 0 {
            return self;
        }
        let envelope = self.working_bytes(n, d, dtype, false);
        let c2 = self.pass2_chunk;
        let waves = |tiles: usize| tiles.div_ceil(sms);
        let cost = |rows: usize| {
            let row_tiles = rows.div_ceil(BM);
            let (bn_g, bn_p) = (tile_width(c2), tile_width(d));
            let g = waves(row_tiles * c2.div_ceil(bn_g)) * bn_g * d;
            let product = waves(row_tiles * d.div_ceil(bn_p)) * bn_p * c2;
            n.div_ceil(rows) * (g + product)
        };
        let least = n.div_ceil(self.rows);
        let rows = (least..=least + 4)
            .map(|blocks| n.div_ceil(blocks).next_multiple_of(BM).min(self.rows))
            .min_by_key(|&rows| (cost(rows), usize::MAX - rows))
            .unwrap_or(self.rows);
        let rowed = Self { rows, ..self };
        (1..=16)
            .rev()
            .map(|k| Self {
                pass2_chunk: self.chunk * k,
                ..rowed
            })
            .find(|b| b.working_bytes(n, d, dtype, false) <= envelope)
            .unwrap_or(rowed)
    }

    /// [`BackwardBlocks::filled`] of the compensated carry's chunk.
    fn waved_chunk(self, n: usize, d: usize, sms: usize) -> Self {
        use burn_kernels_core::gemm::hopper::{BM, tile_width};
        const EPILOGUE_K: usize = 512;
        let waves = |tiles: usize| tiles.div_ceil(sms);
        let (row_tiles, bn_d) = (n.div_ceil(BM), tile_width(d));
        let cost = |c: usize| {
            let bn_g = tile_width(c);
            let g = waves(row_tiles * c.div_ceil(bn_g)) * bn_g * d;
            let dc = waves(c.div_ceil(BM) * d.div_ceil(bn_d)) * bn_d * n;
            let add = waves(row_tiles * d.div_ceil(bn_d)) * bn_d * (c + EPILOGUE_K);
            (g + dc + add) as f64 / c as f64
        };
        let chunk = (MIN_COMPENSATED_CHUNK..=self.chunk)
            .step_by(64)
            .chain([self.chunk])
            .min_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(b.cmp(&a)))
            .unwrap_or(self.chunk);
        Self {
            chunk,
            pass2_chunk: chunk,
            ..self
        }
    }

    /// The vocabulary pass's working set while a chunk's `G` is formed: `G`, the gathered
    /// classifier rows, and the f32 logits unless `in_gemm`.
    fn pass1_bytes(n: usize, chunk: usize, d: usize, s: usize, in_gemm: bool) -> usize {
        let logits = if in_gemm { 0 } else { 4 };
        (logits + s) * n * chunk + s * chunk * d
    }

    /// Bytes the backward holds at its peak besides its inputs, dE and dC, and the `O(n + V)`
    /// vectors (log-sum-exp, scores, ids), for `n` tokens, hidden size `d` and inputs of
    /// `dtype`, with or without a bias. A gathered chunk's classifier rows are counted (a
    /// natural chunk's are a view).
    pub fn working_bytes(&self, n: usize, d: usize, dtype: DType, bias: bool) -> usize {
        let s = dtype.size();
        let (c, rows) = (self.chunk, self.rows);
        let g = s * n * c;
        // The dC rows of a chunk, and its classifier rows where gathered (else a view).
        let dc_rows = s * c * d;
        let copied = |entries: usize| if self.gathered { s * entries * d } else { 0 };
        let classifier = copied(c);
        let logits = if self.in_gemm { 0 } else { 4 * n * c };
        let at_grad = logits + g + classifier;
        // After G is formed (the logits are freed): dE products (or the second pass), the dC
        // rows, and with a bias G's f32 copy for db.
        let product = match self.de {
            DeAccumulation::RowBlocks | DeAccumulation::Compensated => 0,
            _ => 4 * rows * d,
        };
        let mut after = product.max(dc_rows);
        if bias {
            after = after.max(4 * n * c);
        }
        let pass1 = at_grad.max(g + classifier + after);
        match self.de {
            DeAccumulation::Direct => pass1,
            // The i8 corrections live through the pass.
            DeAccumulation::Compensated => n * d + pass1,
            // The accumulator lives through the pass, then beside the rounded dE.
            DeAccumulation::Whole => 4 * n * d + pass1,
            DeAccumulation::RowBlocks => {
                let c2 = self.pass2_chunk;
                let stored = if self.in_gemm {
                    0
                } else {
                    4 * rows * c2.max(d)
                };
                let pass2 = 4 * rows * d + copied(c2) + s * rows * c2 + stored;
                pass1.max(pass2)
            }
        }
    }
}
