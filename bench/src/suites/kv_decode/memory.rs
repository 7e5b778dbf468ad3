//! The memory plan of the KV-cache decode suites.
//!
//! A batch fits when the device memory the runtime's pool would reserve for the model's
//! weights, the cache it holds, and the largest transient working set of a decode step (or of
//! the synthetic fill) stays under `--max-mem-gb`, and the host memory the cache holds stays
//! under `--max-host-mem-gb`. Bytes are not enough: CubeCL 0.10's default pool
//! (`MemoryConfiguration::SubSlices`) hands out slices of whole pages whose size grows with the
//! allocation (up to a quarter of the device), so e.g. two 3 GB tensors cost a 20 GB page on an
//! 80 GB GPU. [`PoolModel`] mirrors those rules and packs each allocation first-fit into pages;
//! one extra page (at most a quarter of the largest) plus 2% and 1 GB is kept back for
//! fragmentation and what the list leaves out (small tensors, the CUDA context).

use std::cell::RefCell;
use std::rc::Rc;

use burn_llama::LlamaConfig;

use super::super::{PoolProps, SuiteOptions};
use crate::harness::{Candidate, Extra, PeerRun};

pub const GB: f64 = 1e9;
/// Bytes of an f16 element: the model, its activations and every cache run in f16.
pub const F16: u64 = 2;

/// CubeCL 0.10's default device memory pool (`MemoryConfiguration::SubSlices`): allocations
/// go to the first pool that accepts them; a pool allocates whole pages and hands out slices.
#[derive(Debug, Clone)]
pub struct PoolModel {
    alignment: u64,
    /// `(page size, largest slice)`, smallest pages first.
    pools: Vec<(u64, u64)>,
}

impl PoolModel {
    /// The pools `MemoryManagement::from_configuration` builds for these device properties.
    pub fn new(p: PoolProps) -> Self {
        const MB: u64 = 1 << 20;
        let align = p.alignment.max(1);
        let mut pools = Vec::new();
        let mut current = p.max_page;
        // The first pool (index 0) takes only empty allocations, so slices start at 2^1.
        let mut base = 1u32;
        while current >= 32 * MB {
            current = (current / 4).next_multiple_of(align);
            pools.push((current, current / 2u64.pow(base)));
            base += 1;
        }
        pools.reverse();
        let top = p.max_page / align * align;
        pools.push((top, top));
        Self {
            alignment: align,
            pools,
        }
    }

    fn pool_of(&self, size: u64) -> Option<usize> {
        self.pools.iter().position(|&(page, max)| {
            max >= size || page.checked_sub(size).is_some_and(|diff| diff * 5 < page)
        })
    }

    /// Page size that serves an allocation of `size` bytes.
    pub fn page_of(&self, size: u64) -> Option<u64> {
        self.pool_of(size).map(|i| self.pools[i].0)
    }

    /// Bytes reserved for the `(size, count)` allocations all live at once, packed
    /// first-fit-decreasing into pages; `None` if one is larger than the largest page.
    pub fn reserved(&self, allocs: &[(u64, usize)]) -> Option<u64> {
        let mut per_pool: Vec<Vec<u64>> = vec![Vec::new(); self.pools.len()];
        for &(size, count) in allocs {
            if size == 0 || count == 0 {
                continue;
            }
            let i = self.pool_of(size)?;
            let slice = size.next_multiple_of(self.alignment);
            per_pool[i].extend(std::iter::repeat_n(slice, count));
        }
        let mut total = 0;
        for (i, mut sizes) in per_pool.into_iter().enumerate() {
            let page = self.pools[i].0;
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            let mut free: Vec<u64> = Vec::new();
            for s in sizes {
                match free.iter_mut().find(|f| **f >= s) {
                    Some(f) => *f -= s,
                    None => free.push(page - s),
                }
            }
            total += free.len() as u64 * page;
        }
        Some(total)
    }

    /// What is kept back besides the packed pages (see the module docs).
    pub fn slack(&self, budget: f64, transient: &[(u64, usize)]) -> u64 {
        let cap = self.pools.last().map_or(0, |&(page, _)| page / 4);
        let page = transient
            .iter()
            .filter_map(|&(s, _)| self.page_of(s))
            .max()
            .unwrap_or(0)
            .min(cap);
        page + (0.02 * budget) as u64 + GB as u64
    }
}

/// Memory one batch needs: device allocations live at the worst moment of each phase (every
/// phase includes what is held throughout), and host bytes.
#[derive(Debug, Clone, Default)]
pub struct Footprint {
    /// Held for the whole run: weights and the filled cache.
    pub held: Vec<(u64, usize)>,
    /// Working sets on top of `held`, one per phase (fill, decode step); the worst counts.
    pub phases: Vec<Vec<(u64, usize)>>,
    pub host: u64,
}

/// The batch chosen for one implementation and why it is not larger.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub batch: usize,
    /// Pool-model estimate of the device memory reserved, with the slack.
    pub device: u64,
    /// Plain sum of the bytes of every tensor counted.
    pub device_raw: u64,
    pub host: u64,
    /// `device`, `host` or `cap`: what stopped the next batch.
    pub bound: &'static str,
}

/// The candidate `name` of a decode suite at the batch `plan` allows (skipped with the plan's
/// reason when none fits): `run` times the steps at that batch and records what it saw in the
/// `Extra` the record gets; tokens/s count one token per sequence and step.
pub fn plan_candidate<'a>(
    name: &'static str,
    plan: &Result<Plan, String>,
    run: impl FnOnce(&Plan, &RefCell<Extra>) -> Result<PeerRun, String> + 'a,
) -> Candidate<'a> {
    match plan {
        Err(e) => Candidate::skipped(name, e.clone()),
        Ok(p) => {
            let p = *p;
            let info = Rc::new(RefCell::new(Extra::default()));
            let cell = info.clone();
            Candidate::timed_elsewhere(name, move || run(&p, &cell))
                .with_tokens(p.batch as f64)
                .with_extra(move || info.take())
        }
    }
}

/// One line for a batch plan: the batch, what bounds it, the device estimate, and the host
/// bytes where the cache keeps any.
pub fn describe(p: &Result<Plan, String>) -> String {
    match p {
        Ok(p) => format!(
            "batch {} ({}-bound): est. {:.1} GB device (tensors {:.1} GB){}",
            p.batch,
            p.bound,
            p.device as f64 / GB,
            p.device_raw as f64 / GB,
            if p.host > 0 {
                format!(", {:.1} GB host", p.host as f64 / GB)
            } else {
                String::new()
            }
        ),
        Err(e) => format!("skipped: {e}"),
    }
}

/// Device and host estimate of one footprint, or `None` when an allocation is larger than the
/// pool's largest page.
pub fn estimate(pool: &PoolModel, budget: f64, f: &Footprint) -> Option<(u64, u64)> {
    let mut worst = (0u64, 0u64);
    let phases: Vec<&[(u64, usize)]> = if f.phases.is_empty() {
        vec![&[]]
    } else {
        f.phases.iter().map(Vec::as_slice).collect()
    };
    for phase in phases {
        let all: Vec<(u64, usize)> = f.held.iter().chain(phase).copied().collect();
        let dev = pool.reserved(&all)? + pool.slack(budget, phase);
        let raw: u64 = all.iter().map(|&(s, n)| s * n as u64).sum();
        if dev > worst.0 {
            worst = (dev, raw);
        }
    }
    Some(worst)
}

/// The largest batch up to `cap` whose footprint fits both budgets.
///
/// # Errors
/// Why batch 1 does not fit.
pub fn plan(
    opts: &SuiteOptions,
    cap: usize,
    footprint: impl Fn(usize) -> Footprint,
) -> Result<Plan, String> {
    let pool = PoolModel::new(opts.pool);
    // Err: why not, and which budget it breaks.
    let fits = |b: usize| -> Result<Plan, (String, &'static str)> {
        let f = footprint(b);
        let (device, device_raw) = estimate(&pool, opts.max_mem_bytes, &f).ok_or_else(|| {
            (
                format!("batch {b}: one tensor exceeds the pool's largest page"),
                "device",
            )
        })?;
        if device as f64 > opts.max_mem_bytes {
            let why = format!(
                "batch {b} needs ~{:.1} GB of device memory (pool estimate; budget {:.1} GB)",
                device as f64 / GB,
                opts.max_mem_bytes / GB
            );
            return Err((why, "device"));
        }
        if f.host as f64 > opts.max_host_mem_bytes {
            let why = format!(
                "batch {b} needs ~{:.1} GB of host memory (budget {:.1} GB)",
                f.host as f64 / GB,
                opts.max_host_mem_bytes / GB
            );
            return Err((why, "host"));
        }
        Ok(Plan {
            batch: b,
            device,
            device_raw,
            host: f.host,
            bound: "cap",
        })
    };
    let mut best = fits(1).map_err(|(why, _)| why)?;
    for b in 2..=cap {
        match fits(b) {
            Ok(p) => best = p,
            Err((_, bound)) => {
                best.bound = bound;
                break;
            }
        }
    }
    Ok(best)
}

/// The device allocations of `cfg`'s weights in f16 (and the f32 RoPE tables of
/// `rope_positions`).
pub fn weight_allocs(cfg: &LlamaConfig, rope_positions: usize) -> Vec<(u64, usize)> {
    let (h, d, f, v) = (
        cfg.hidden_size as u64,
        cfg.head_dim as u64,
        cfg.intermediate_size as u64,
        cfg.vocab_size as u64,
    );
    let (hq, hkv, l) = (
        cfg.num_heads as u64,
        cfg.num_kv_heads as u64,
        cfg.num_layers,
    );
    let mut out = vec![
        (v * h * F16, if cfg.tie_word_embeddings { 1 } else { 2 }),
        (h * F16, 2 * l + 1),
        (h * hq * d * F16, 2 * l),
        (h * hkv * d * F16, 2 * l),
        (h * f * F16, 3 * l),
        (rope_positions as u64 * d / 2 * 4, 2),
    ];
    out.retain(|&(s, n)| s > 0 && n > 0);
    out
}

/// Weight bytes of `cfg` in f16.
pub fn weight_bytes(cfg: &LlamaConfig) -> u64 {
    weight_allocs(cfg, 0)
        .iter()
        .map(|&(s, n)| s * n as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suites::kv_decode::tests::H100;

    fn h100() -> PoolModel {
        PoolModel::new(H100)
    }

    #[test]
    fn pools_mirror_cubecl() {
        let p = h100();
        let pages: Vec<u64> = p.pools.iter().map(|&(page, _)| page).collect();
        assert_eq!(pages.len(), 6);
        assert_eq!(*pages.last().unwrap(), 85_520_809_984 / 4 / 512 * 512);
        // A 3 GB tensor takes the largest page, a 2 GB one the quarter below it.
        assert_eq!(p.page_of(3_000_000_000), Some(pages[5]));
        assert_eq!(p.page_of(2_000_000_000), Some(pages[4]));
        // Two slices of one page, a third starts another.
        let s = pages[4] / 3;
        assert_eq!(p.reserved(&[(s, 2)]), Some(pages[4]));
        assert_eq!(p.reserved(&[(s, 4)]), Some(2 * pages[4]));
        assert_eq!(p.reserved(&[(pages[5] + 1, 1)]), None);
    }
}
