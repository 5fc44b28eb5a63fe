//! Sparsifying task vectors: magnitude top-k (TIES) and Bernoulli masks (DARE), with the
//! rescaling rules of mergekit and of the official code (docs/reference/merges.md#ties, #dare).
//!
//! **Top-k by selection.** mergekit keeps the `k = max(1, int(density * numel))` largest
//! magnitudes with a full `argsort`. sinkmerge finds the same k-th largest magnitude by a
//! two-level radix selection on the magnitude's bit pattern (for non-negative floats the bit
//! order is the numeric order): a parallel histogram of the upper 16 bits finds the bucket that
//! holds the threshold, then the entries of that one bucket are examined exactly. That is two
//! streaming passes and no sort.
//!
//! **Ties at the threshold.** When several entries share the threshold magnitude, sinkmerge keeps
//! the ones with the lowest flat indices: the result of a *stable* descending sort. torch's
//! `argsort` (unstable) gives that order for tensors of up to 16 elements and an
//! implementation-defined order beyond (checked in `tools/gen_merge_goldens.py`), so mergekit's
//! choice among tied entries of larger tensors is arbitrary; sinkmerge's is documented and
//! deterministic.

use std::ops::Range;

use rand::Rng;
use rayon::prelude::*;

use super::job::{Block, TensorJob};
use crate::error::Result;
use crate::linalg::tensor_rng;

const BUCKETS: usize = 1 << 16;

/// The magnitude of `x` as an order-preserving integer key.
#[inline]
pub fn magnitude_key(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// Which entries of one task vector survive magnitude trimming.
#[derive(Debug, Clone, PartialEq)]
pub enum Cut {
    /// No trimming (density >= 1).
    KeepAll,
    /// Keep entries whose magnitude key is above `key`; of those equal to it, keep `ties`.
    Above { key: u32, ties: Ties },
}

/// Which entries equal to the threshold survive.
#[derive(Debug, Clone, PartialEq)]
pub enum Ties {
    /// All of them (the official TIES rule `|x| >= kth value`).
    All,
    /// Exactly these flat indices (sorted): the lowest-indexed ones, filling up to k.
    Listed(Vec<usize>),
}

impl Cut {
    /// Whether the entry `x` at flat index `index` is kept.
    #[inline]
    pub fn keeps(&self, x: f32, index: usize) -> bool {
        match self {
            Cut::KeepAll => true,
            Cut::Above { key, ties } => {
                let k = magnitude_key(x);
                k > *key
                    || (k == *key
                        && match ties {
                            Ties::All => true,
                            Ties::Listed(list) => list.binary_search(&index).is_ok(),
                        })
            }
        }
    }

    /// Zero the entries of `delta` (a block starting at flat index `start`) that are cut.
    pub fn apply(&self, delta: &mut [f32], start: usize) {
        let Cut::Above { key, ties } = self else {
            return;
        };
        let key = *key;
        // Below the threshold: a branch-free pass. At it: rare, decided one by one.
        let mut at_threshold = false;
        for x in delta.iter_mut() {
            let k = magnitude_key(*x);
            at_threshold |= k == key;
            *x = if k < key { 0.0 } else { *x };
        }
        if at_threshold {
            if let Ties::Listed(list) = ties {
                for (j, x) in delta.iter_mut().enumerate() {
                    if magnitude_key(*x) == key && list.binary_search(&(start + j)).is_err() {
                        *x = 0.0;
                    }
                }
            }
        }
    }
}

/// mergekit's count of kept entries: `max(1, int(density * numel))`.
pub fn keep_count(density: f64, numel: usize) -> usize {
    ((density * numel as f64) as usize).clamp(1, numel.max(1))
}

/// Local (per-tensor) top-k cuts of every task vector of `job`; `densities[i]` for model `i`.
pub fn top_k_cuts(job: &TensorJob, densities: &[f64]) -> Result<Vec<Cut>> {
    let n = job.numel();
    let wanted: Vec<Option<usize>> = densities
        .iter()
        .map(|&d| (d < 1.0 && n > 0).then(|| keep_count(d, n)))
        .collect();
    if wanted.iter().all(Option::is_none) {
        return Ok(vec![Cut::KeepAll; densities.len()]);
    }
    // Pass 1: histogram of the upper 16 bits of every magnitude.
    let hist = histograms(job, &wanted, |_, key| Some((key >> 16) as usize))?;
    let buckets: Vec<Option<(u32, usize)>> = wanted
        .iter()
        .zip(&hist)
        .map(|(k, h)| k.map(|k| bucket_of_kth(h, k)))
        .collect();
    // Pass 2: the entries of each threshold bucket, in flat order.
    let candidates = job.map_blocks(|block| {
        let base = block.base()?;
        buckets
            .iter()
            .enumerate()
            .map(|(i, b)| match b {
                None => Ok(Vec::new()),
                Some((bucket, _)) => {
                    let d = block.delta_from(i, &base)?;
                    Ok(d.iter()
                        .enumerate()
                        .filter(|(_, &x)| magnitude_key(x) >> 16 == *bucket)
                        .map(|(j, &x)| (block.start() + j, (magnitude_key(x) & 0xffff) as u16))
                        .collect::<Vec<_>>())
                }
            })
            .collect::<Result<Vec<_>>>()
    })?;
    Ok(buckets
        .iter()
        .enumerate()
        .map(|(i, b)| match b {
            None => Cut::KeepAll,
            Some((bucket, need)) => {
                let entries: Vec<(usize, u16)> = candidates
                    .iter()
                    .flat_map(|per_block| per_block[i].iter().copied())
                    .collect();
                cut_in_bucket(*bucket, *need, &entries)
            }
        })
        .collect())
}

/// For a histogram `h` (descending keys = descending buckets) and the rank `k` (1-based) of
/// the wanted entry from the top: its bucket and how many entries of that bucket are wanted.
fn bucket_of_kth(h: &[u64], k: usize) -> (u32, usize) {
    let mut above = 0u64;
    for b in (0..h.len()).rev() {
        if above + h[b] >= k as u64 {
            return (b as u32, (k as u64 - above) as usize);
        }
        above += h[b];
    }
    unreachable!("k <= number of entries")
}

/// Keep the `need` largest of `entries` (flat index, lower key bits), ties to the lowest index.
fn cut_in_bucket(bucket: u32, need: usize, entries: &[(usize, u16)]) -> Cut {
    let mut low_hist = vec![0u64; BUCKETS];
    for &(_, low) in entries {
        low_hist[low as usize] += 1;
    }
    let (low, ties) = bucket_of_kth(&low_hist, need);
    let key = (bucket << 16) | low;
    let listed: Vec<usize> = entries
        .iter()
        .filter(|&&(_, l)| l as u32 == low)
        .map(|&(index, _)| index)
        .take(ties)
        .collect();
    Cut::Above {
        key,
        ties: Ties::Listed(listed),
    }
}

/// Per-task histograms over `BUCKETS` bins of `bin(task, magnitude key)` for the tasks with a
/// `Some` in `active`, over the whole tensor. Integer counts, so the parallel sum is exact.
fn histograms<T, F>(job: &TensorJob, active: &[Option<T>], bin: F) -> Result<Vec<Vec<u64>>>
where
    T: Sync,
    F: Fn(usize, u32) -> Option<usize> + Sync,
{
    let tasks = active.len();
    let empty = || vec![Vec::<u64>::new(); tasks];
    job.blocks()
        .into_par_iter()
        .try_fold(empty, |mut acc, range| -> Result<Vec<Vec<u64>>> {
            let block = Block { job, range };
            let base = block.base()?;
            for (i, a) in active.iter().enumerate() {
                if a.is_none() {
                    continue;
                }
                let d = block.delta_from(i, &base)?;
                let h = &mut acc[i];
                if h.is_empty() {
                    h.resize(BUCKETS, 0);
                }
                for &x in d.iter() {
                    if let Some(b) = bin(i, magnitude_key(x)) {
                        h[b] += 1;
                    }
                }
            }
            Ok(acc)
        })
        .try_reduce(empty, |mut a, b| {
            for (x, y) in a.iter_mut().zip(b) {
                if x.is_empty() {
                    *x = y;
                } else if !y.is_empty() {
                    for (p, q) in x.iter_mut().zip(y) {
                        *p += q;
                    }
                }
            }
            Ok(a)
        })
        .map(|mut h| {
            for x in h.iter_mut() {
                x.resize(BUCKETS, 0);
            }
            h
        })
}

/// Global (official TIES) cuts: for each task, one threshold over every entry of every job.
/// With `n` entries in all and `k = int(n * density)` to keep, the official code takes
/// `kth = kthvalue(|M|, n - k)` and keeps entries `>= kth`, ties included
/// (`ties-merging/src/utils/merge_utils.py:L122-142`). Two streaming passes over all jobs.
pub fn global_cuts(jobs: &[TensorJob], densities: &[f64]) -> Result<Vec<Cut>> {
    let tasks = densities.len();
    let all = vec![Some(()); tasks];
    let high = sum_over_jobs(jobs, &all, |_, key| Some((key >> 16) as usize))?;
    let ranks: Vec<Option<(u32, usize)>> = high
        .iter()
        .zip(densities)
        .map(|(h, &d)| {
            let n: u64 = h.iter().sum();
            if d >= 1.0 || n == 0 {
                return None;
            }
            // The (n - k)-th smallest is the (k + 1)-th largest.
            let k = (n as f64 * d) as u64;
            Some(bucket_of_kth(h, (k + 1).min(n) as usize))
        })
        .collect();
    let low = sum_over_jobs(jobs, &all, |i, key| match ranks[i] {
        Some((bucket, _)) if key >> 16 == bucket => Some((key & 0xffff) as usize),
        _ => None,
    })?;
    Ok(ranks
        .iter()
        .zip(&low)
        .map(|(rank, low_hist)| match rank {
            None => Cut::KeepAll,
            Some((bucket, need)) => {
                let (low, _) = bucket_of_kth(low_hist, *need);
                Cut::Above {
                    key: (bucket << 16) | low,
                    ties: Ties::All,
                }
            }
        })
        .collect())
}

fn sum_over_jobs<F>(jobs: &[TensorJob], active: &[Option<()>], bin: F) -> Result<Vec<Vec<u64>>>
where
    F: Fn(usize, u32) -> Option<usize> + Sync,
{
    let mut total = vec![vec![0u64; BUCKETS]; active.len()];
    for job in jobs {
        let h = histograms(job, active, &bin)?;
        for (t, hj) in total.iter_mut().zip(h) {
            for (p, q) in t.iter_mut().zip(hj) {
                *p += q;
            }
        }
    }
    Ok(total)
}

/// Sum of |x| of one task vector before and after its cut, in f64, over the whole tensor (for
/// mergekit's L1 rescale). Per-block sums are added in block order (deterministic).
pub fn l1_before_after(job: &TensorJob, i: usize, cut: &Cut) -> Result<(f64, f64)> {
    let parts = job.map_blocks(|block| {
        let d = block.delta(i)?;
        let mut before = 0f64;
        let mut after = 0f64;
        for (j, &x) in d.iter().enumerate() {
            let a = x.abs() as f64;
            before += a;
            if cut.keeps(x, block.start() + j) {
                after += a;
            }
        }
        Ok((before, after))
    })?;
    Ok(parts
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y)))
}

/// mergekit's L1 rescale factor `||d||_1 / ||d'||_1`, or 1 when either norm is below 1e-7
/// (`sparsify.py: rescaled_masked_tensor`).
pub fn l1_factor(before: f64, after: f64) -> f32 {
    if before < 1e-7 || after < 1e-7 {
        1.0
    } else {
        (before / after) as f32
    }
}

/// A Bernoulli keep-mask for elements `range` of model `model`'s task vector of tensor `tensor`:
/// bit `j` of the result is element `range.start + j`, kept with probability `density`.
///
/// Every (seed, tensor) pair has its own ChaCha8 stream ([`tensor_rng`]), each model its own
/// sub-stream, and element `e` uses word `e` of it, so the mask does not depend on how the
/// tensor is split into blocks or threads.
pub fn bernoulli_mask(
    seed: u64,
    tensor: &str,
    model: usize,
    range: Range<usize>,
    density: f64,
) -> Vec<u64> {
    let threshold = (density * 4_294_967_296.0).round() as u64;
    let mut rng = tensor_rng(seed, tensor);
    rng.set_stream(model as u64);
    rng.set_word_pos(range.start as u128);
    let mut bits = vec![0u64; range.len().div_ceil(64)];
    // Draw 4096 words at a time (a multiple of 64, so chunks fill whole mask words).
    let mut words = [0u32; 4096];
    for (chunk, out) in (0..range.len())
        .step_by(words.len())
        .zip(bits.chunks_mut(words.len() / 64))
    {
        let n = words.len().min(range.len() - chunk);
        rng.fill(&mut words[..n]);
        for (w, draws) in out.iter_mut().zip(words[..n].chunks(64)) {
            let mut b = 0u64;
            for (k, &r) in draws.iter().enumerate() {
                b |= (((r as u64) < threshold) as u64) << k;
            }
            *w = b;
        }
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether bit `j` of a mask is set.
    #[inline]
    fn bit(mask: &[u64], j: usize) -> bool {
        mask[j / 64] >> (j % 64) & 1 == 1
    }

    /// The stable-descending-sort reference: indices of the k largest |x|, ties to lower index.
    fn reference_top_k(x: &[f32], k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| x[b].abs().total_cmp(&x[a].abs()).then(a.cmp(&b)));
        let mut kept = idx[..k].to_vec();
        kept.sort();
        kept
    }

    #[test]
    fn bucket_cut_matches_a_stable_sort_with_heavy_ties() {
        // Values from a tiny set so most of them tie, spread over a few buckets.
        let vals = [0.5f32, -0.5, 0.25, 1.0, -1.0, 0.125, 0.5000001, 0.0];
        let x: Vec<f32> = (0..1000)
            .map(|i| vals[(i * 7 + i / 3) % vals.len()])
            .collect();
        for k in [1, 2, 50, 125, 126, 333, 999, 1000] {
            let mut high = vec![0u64; BUCKETS];
            for &v in &x {
                high[(magnitude_key(v) >> 16) as usize] += 1;
            }
            let (bucket, need) = bucket_of_kth(&high, k);
            let entries: Vec<(usize, u16)> = x
                .iter()
                .enumerate()
                .filter(|(_, &v)| magnitude_key(v) >> 16 == bucket)
                .map(|(i, &v)| (i, (magnitude_key(v) & 0xffff) as u16))
                .collect();
            let cut = cut_in_bucket(bucket, need, &entries);
            let kept: Vec<usize> = (0..x.len()).filter(|&i| cut.keeps(x[i], i)).collect();
            assert_eq!(kept, reference_top_k(&x, k), "k = {k}");
        }
    }

    #[test]
    fn keep_count_follows_mergekit() {
        assert_eq!(keep_count(0.2, 10), 2);
        assert_eq!(keep_count(0.2, 4), 1); // int(0.8) = 0 -> at least one
        assert_eq!(keep_count(0.7, 10), 7); // int(7.000000000000001)
        assert_eq!(keep_count(0.3, 10), 3); // int(3.0000000000000004)
    }

    #[test]
    fn masks_do_not_depend_on_blocking() {
        let whole = bernoulli_mask(7, "t", 1, 0..1000, 0.3);
        let a = bernoulli_mask(7, "t", 1, 0..333, 0.3);
        let b = bernoulli_mask(7, "t", 1, 333..1000, 0.3);
        for j in 0..1000 {
            let split = if j < 333 {
                bit(&a, j)
            } else {
                bit(&b, j - 333)
            };
            assert_eq!(bit(&whole, j), split, "element {j}");
        }
        let other_model = bernoulli_mask(7, "t", 2, 0..1000, 0.3);
        let other_seed = bernoulli_mask(8, "t", 1, 0..1000, 0.3);
        assert_ne!(whole, other_model);
        assert_ne!(whole, other_seed);
        // Element e is decided by word e of the stream: the same as drawing one by one.
        let mut rng = tensor_rng(7, "t");
        rng.set_stream(1);
        for j in 0..1000 {
            let r = rand::RngCore::next_u32(&mut rng) as u64;
            assert_eq!(
                bit(&whole, j),
                r < (0.3f64 * 4_294_967_296.0).round() as u64,
                "{j}"
            );
        }
        let kept = (0..1000).filter(|&j| bit(&whole, j)).count();
        // 3 sigma of Binomial(1000, 0.3) is about 43.
        assert!((kept as f64 - 300.0).abs() < 43.5, "{kept}");
    }
}
