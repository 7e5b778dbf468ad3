//! GGUF files: parsed with `ggus`, blocks decoded with `ggml-quants`, tensors renamed to
//! Hugging Face names and laid out as Hugging Face stores them.

use super::{Checkpoint, HostTensor, LoadError, validate};
use ggml_quants::{DeltaMin, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, QuantExt, f16};
use ggus::{DEFAULT_ALIGNMENT, GENERAL_ALIGNMENT, GGuf, GGufReader};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

pub use ggus::GGmlType;

mod meta;
use meta::{Meta, config_from_meta, tokenizer_from_meta};

/// llama.cpp's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;

pub(crate) fn load(path: &Path) -> Result<Checkpoint, LoadError> {
    let file = read_aligned(path)?;
    let bytes = file.as_bytes();
    check_layout(path, bytes)?;
    let gguf = GGuf::new(bytes).map_err(|e| LoadError::format(path, e.to_string()))?;
    let meta = Meta { path, gguf: &gguf };

    let arch = meta.str("general.architecture")?;
    if arch != "llama" {
        return Err(LoadError::format(
            path,
            format!("architecture `{arch}` is not supported (only `llama`)"),
        ));
    }
    let tokenizer = tokenizer_from_meta(&meta)?;
    let rope_freqs = match gguf.tensors.get("rope_freqs.weight") {
        Some(t) => Some(read_tensor(path, &gguf, "rope_freqs.weight", t)?.1),
        None => None,
    };
    let config = config_from_meta(
        &meta,
        tokenizer.vocab_size(),
        gguf.tensors.contains_key("output.weight"),
        rope_freqs.as_deref(),
    )?;

    let mut tensors = HashMap::with_capacity(gguf.tensors.len());
    for (&name, t) in &gguf.tensors {
        let Some(hf) = hf_name(name) else {
            if name != "rope_freqs.weight" {
                log::warn!("{}: ignoring tensor `{name}`", path.display());
            }
            continue;
        };
        let (mut shape, mut data) = read_tensor(path, &gguf, name, t)?;
        // GGUF lists dimensions innermost first.
        shape.reverse();
        let heads = if hf.ends_with("q_proj.weight") {
            Some(config.num_heads)
        } else if hf.ends_with("k_proj.weight") {
            Some(config.num_kv_heads)
        } else {
            None
        };
        if let Some(n_head) = heads {
            let expected = [n_head * config.head_dim, config.hidden_size];
            if shape != expected || config.head_dim % 2 != 0 {
                return Err(LoadError::ShapeMismatch {
                    tensor: hf,
                    expected: expected.to_vec(),
                    found: shape,
                });
            }
            data = unpermute_qk(&data, n_head, shape[0], shape[1]);
        }
        tensors.insert(hf, HostTensor { shape, data });
    }
    validate(&config, &tensors)?;
    Ok(Checkpoint {
        config,
        tensors,
        tokenizer,
    })
}

/// The file's bytes in an 8-byte-aligned buffer: `ggus` reads the header as a struct of
/// `u64`s in place.
struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialized bytes and any byte pattern is a u8.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the view unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

fn read_aligned(path: &Path) -> Result<AlignedBytes, LoadError> {
    let io = |e| LoadError::io(path, e);
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len() as usize;
    let mut buf = AlignedBytes {
        words: vec![0; len.div_ceil(8)],
        len,
    };
    file.read_exact(buf.as_bytes_mut()).map_err(io)?;
    Ok(buf)
}

/// The GGML types `ggus` knows the block size of.
fn ggml_type(id: u32) -> Option<GGmlType> {
    use GGmlType::*;
    Some(match id {
        0 => F32,
        1 => F16,
        2 => Q4_0,
        3 => Q4_1,
        6 => Q5_0,
        7 => Q5_1,
        8 => Q8_0,
        9 => Q8_1,
        10 => Q2K,
        11 => Q3K,
        12 => Q4K,
        13 => Q5K,
        14 => Q6K,
        15 => Q8K,
        16 => IQ2XXS,
        17 => IQ2XS,
        18 => IQ3XXS,
        19 => IQ1S,
        20 => IQ4NL,
        21 => IQ3S,
        22 => IQ2S,
        23 => IQ4XS,
        24 => I8,
        25 => I16,
        26 => I32,
        27 => I64,
        28 => F64,
        29 => IQ1M,
        30 => BF16,
        _ => return None,
    })
}

/// Walks the header, metadata and tensor table once before `ggus` does: `ggus` reads type
/// tags straight into Rust enums and trusts tensor shapes and offsets, so a corrupted file
/// would make it panic or misbehave instead of returning an error.
fn check_layout(path: &Path, bytes: &[u8]) -> Result<(), LoadError> {
    let bad = |msg: String| LoadError::format(path, msg);
    let eof = |_| LoadError::format(path, "unexpected end of file");
    let mut r = GGufReader::new(bytes);

    let magic: [u8; 4] = r.read().map_err(eof)?;
    if &magic != b"GGUF" {
        return Err(bad("not a GGUF file (bad magic)".into()));
    }
    let version: u32 = r.read().map_err(eof)?;
    if version != 3 {
        return Err(bad(format!(
            "GGUF version {version} is not supported (only 3)"
        )));
    }
    let n_tensors: u64 = r.read().map_err(eof)?;
    let n_kv: u64 = r.read().map_err(eof)?;
    // Every entry takes more than 8 bytes, so larger counts cannot be honest.
    let limit = bytes.len() as u64 / 8;
    if n_tensors > limit || n_kv > limit {
        return Err(bad(format!(
            "implausible counts: {n_tensors} tensors, {n_kv} metadata entries"
        )));
    }

    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..n_kv {
        let key = r
            .read_str()
            .map_err(|e| bad(format!("metadata key: {e:?}")))?;
        let ty: u32 = r.read().map_err(eof)?;
        if key == GENERAL_ALIGNMENT {
            let mut v = r.clone();
            alignment = match ty {
                4 => v.read::<u32>().map_err(eof)? as usize,
                10 => v.read::<u64>().map_err(eof)? as usize,
                _ => return Err(bad(format!("`{key}` has value type {ty}"))),
            };
            if alignment == 0 {
                return Err(bad(format!("`{key}` is 0")));
            }
        }
        skip_values(&mut r, ty, 1).map_err(|e| bad(format!("metadata `{key}`: {e}")))?;
    }

    let mut data_len = 0u64;
    for _ in 0..n_tensors {
        let name = r
            .read_str()
            .map_err(|e| bad(format!("tensor name: {e:?}")))?;
        let ndim: u32 = r.read().map_err(eof)?;
        if ndim == 0 || ndim > MAX_DIMS {
            return Err(bad(format!("tensor `{name}` has {ndim} dimensions")));
        }
        let dims = (0..ndim)
            .map(|_| r.read::<u64>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(eof)?;
        let ty: u32 = r.read().map_err(eof)?;
        let offset: u64 = r.read().map_err(eof)?;
        let ggml = ggml_type(ty).ok_or_else(|| LoadError::UnsupportedQuant {
            tensor: name.to_string(),
            quant: format!("GGML type id {ty}"),
        })?;
        let size = ggml.size();
        let (block, type_size) = (size.block_size as u64, size.type_size as u64);
        let nbytes = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .filter(|_| dims[0].is_multiple_of(block))
            .and_then(|n| (n / block).checked_mul(type_size))
            .ok_or_else(|| {
                bad(format!(
                    "tensor `{name}`: shape {dims:?} does not fit {ggml:?} blocks of {block}"
                ))
            })?;
        let end = offset
            .checked_add(nbytes)
            .ok_or_else(|| bad(format!("tensor `{name}`: offset {offset} overflows")))?;
        data_len = data_len.max(end);
    }

    let header_len = bytes.len() - r.remaining().len();
    let data_start = if n_tensors == 0 {
        header_len
    } else {
        header_len + (alignment - header_len % alignment) % alignment
    };
    let available = bytes.len().saturating_sub(data_start) as u64;
    if data_len > available {
        return Err(bad(format!(
            "truncated: tensor data needs {data_len} bytes after the header, the file has {available}"
        )));
    }
    Ok(())
}

/// Skips `count` metadata values of type tag `ty`, refusing tags `ggus` cannot represent.
fn skip_values(r: &mut GGufReader<'_>, ty: u32, count: u64) -> Result<(), String> {
    let width = match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => {
            for _ in 0..count {
                r.read_str().map_err(|e| format!("{e:?}"))?;
            }
            return Ok(());
        }
        9 => {
            for _ in 0..count {
                let elem: u32 = r.read().map_err(|e| format!("{e:?}"))?;
                let len: u64 = r.read().map_err(|e| format!("{e:?}"))?;
                skip_values(r, elem, len)?;
            }
            return Ok(());
        }
        _ => return Err(format!("unknown value type {ty}")),
    };
    let rest = r.remaining();
    let n = count
        .checked_mul(width)
        .filter(|&n| n <= rest.len() as u64)
        .ok_or("unexpected end of file")?;
    *r = GGufReader::new(&rest[n as usize..]);
    Ok(())
}

/// Dimensions (GGUF order, innermost first) and dequantized values of one tensor.
fn read_tensor(
    path: &Path,
    gguf: &GGuf<'_>,
    name: &str,
    meta: &ggus::GGufTensorMeta<'_>,
) -> Result<(Vec<usize>, Vec<f32>), LoadError> {
    let info = meta.to_info();
    let shape: Vec<usize> = info.shape().iter().map(|&d| d as usize).collect();
    let (start, len) = (info.offset(), info.nbytes());
    let raw = gguf
        .data
        .get(start..start + len)
        .ok_or_else(|| LoadError::format(path, format!("tensor `{name}` lies past the data")))?;
    let data = dequantize(name, info.ty(), raw, shape.iter().product())?;
    Ok((shape, data))
}

/// Decodes `numel` values of GGML type `ty` from `raw`: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
/// Q5_0 and Q5_1 (blocks of 32 with per-block f16 scale, and min for the `_1` types).
/// Other types give [`LoadError::UnsupportedQuant`]; a byte count that does not hold
/// `numel` values gives [`LoadError::ShapeMismatch`] (in elements).
pub fn dequantize(
    tensor: &str,
    ty: GGmlType,
    raw: &[u8],
    numel: usize,
) -> Result<Vec<f32>, LoadError> {
    let (block, type_size) = match ty {
        GGmlType::F32 => (1, 4),
        GGmlType::F16 | GGmlType::BF16 => (1, 2),
        GGmlType::Q8_0 => (32, 34),
        GGmlType::Q4_0 => (32, 18),
        GGmlType::Q4_1 => (32, 20),
        GGmlType::Q5_0 => (32, 22),
        GGmlType::Q5_1 => (32, 24),
        other => {
            return Err(LoadError::UnsupportedQuant {
                tensor: tensor.to_string(),
                quant: format!("{other:?}"),
            });
        }
    };
    if !numel.is_multiple_of(block) || raw.len() != numel / block * type_size {
        return Err(LoadError::ShapeMismatch {
            tensor: tensor.to_string(),
            expected: vec![numel],
            found: vec![raw.len() / type_size * block],
        });
    }
    let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]);
    let dm = |b: &[u8]| DeltaMin {
        delta: h(b, 0),
        min: h(b, 2),
    };
    let arr = |b: &[u8]| -> [u8; 16] { b.try_into().expect("16 bytes") };
    Ok(match ty {
        GGmlType::F32 => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        GGmlType::F16 => raw.chunks_exact(2).map(|b| h(b, 0).to_f32()).collect(),
        GGmlType::BF16 => raw
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        GGmlType::Q8_0 => blocks::<Q8_0>(raw, type_size, |b| Q8_0 {
            delta: h(b, 0),
            quants: std::array::from_fn(|i| b[2 + i] as i8),
        }),
        GGmlType::Q4_0 => blocks::<Q4_0>(raw, type_size, |b| Q4_0 {
            delta: h(b, 0),
            quants: arr(&b[2..18]),
        }),
        GGmlType::Q4_1 => blocks::<Q4_1>(raw, type_size, |b| Q4_1 {
            delta_min: dm(b),
            quants: arr(&b[4..20]),
        }),
        GGmlType::Q5_0 => blocks::<Q5_0>(raw, type_size, |b| Q5_0 {
            delta: h(b, 0),
            qh: [b[2], b[3], b[4], b[5]],
            ql: arr(&b[6..22]),
        }),
        GGmlType::Q5_1 => blocks::<Q5_1>(raw, type_size, |b| Q5_1 {
            delta_min: dm(b),
            qh: [b[4], b[5], b[6], b[7]],
            ql: arr(&b[8..24]),
        }),
        _ => unreachable!("filtered above"),
    })
}

/// Parses `raw` into 32-value blocks (by copy: tensor data need not be aligned for the
/// block structs) and dequantizes them in parallel.
fn blocks<B: QuantExt<f32, 32>>(raw: &[u8], size: usize, parse: impl Fn(&[u8]) -> B) -> Vec<f32> {
    let blocks: Vec<B> = raw.chunks_exact(size).map(parse).collect();
    let mut out = vec![0.0; blocks.len() * 32];
    B::dequantize_slice(&mut out, &blocks).expect("one block per 32 values");
    out
}

/// Undoes the row permutation llama.cpp's converter applies to Q and K projections (for its
/// interleaved RoPE), giving back Hugging Face's layout for rotate-half RoPE. `data` is
/// `[n_head * head_dim, cols]` row-major; within each head, GGUF row `2 i + t` is Hugging
/// Face row `t * head_dim / 2 + i`.
pub fn unpermute_qk(data: &[f32], n_head: usize, rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(
        data.len(),
        rows * cols,
        "unpermute_qk: data is not rows × cols"
    );
    assert!(
        rows.is_multiple_of(2 * n_head),
        "unpermute_qk: rows not 2 × heads"
    );
    let half = rows / n_head / 2;
    let mut out = vec![0.0; data.len()];
    for h in 0..n_head {
        for t in 0..2 {
            for i in 0..half {
                let dst = h * 2 * half + t * half + i;
                let src = h * 2 * half + 2 * i + t;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// The Hugging Face name of a llama.cpp tensor name, or `None` for tensors the model does
/// not use.
pub fn hf_name(gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}
