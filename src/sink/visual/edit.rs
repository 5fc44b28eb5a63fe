//! The key edit and its controls, applied inside the forward pass through the decoder's
//! [`KeyEdit`] seam, and the random numbers they draw (`docs/reference/visual-sinks.md`, "The
//! key edit").

use std::sync::Mutex;

use crate::error::Result;
use crate::forward::decoder::{KeyEdit, KeyStage};

use super::stats::{centered_cosines, mean_keys};

/// SplitMix64 (Steele, Lea and Flood 2014), written out in the docs so that the Python
/// reference draws the same numbers.
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// Stream `stream` of the `image`-th image of a prompt.
    pub fn stream(seed: u64, image: usize, stream: u64) -> SplitMix64 {
        let index = 3 * image as u64 + stream + 1;
        SplitMix64(seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal (Box–Muller, the cosine branch).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform();
        let u2 = self.uniform();
        (-2.0 * (1.0 - u1).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// `k` of `0..n` by a partial Fisher–Yates shuffle, sorted.
    pub fn pick(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..n).collect();
        for t in 0..k.min(n) {
            let j = t + (self.uniform() * (n - t) as f64) as usize;
            idx.swap(t, j);
        }
        let mut chosen = idx[..k.min(n)].to_vec();
        chosen.sort_unstable();
        chosen
    }
}

/// Which edit a pass applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EditKind {
    None,
    /// Project the text-sink direction out of the gated tokens' keys.
    Remove,
    /// Set eight random image tokens' keys to the text sink's.
    Align,
}

/// How many image tokens `align` sets.
pub const ALIGNED: usize = 8;

/// One image's part of an edit: its token positions, and the draws its control needs.
struct ImageEdit {
    positions: Vec<usize>,
    /// `align`: indices into `positions`.
    aligned: Vec<usize>,
    /// The control's random vectors, per probed layer (in `layers` order): remove: one
    /// direction per KV head; align: one key per aligned token and KV head.
    random: Vec<Vec<Vec<f64>>>,
}

/// An edit of one pass: what it does at each probed layer, and what it touched.
pub struct Editor {
    kind: EditKind,
    control: bool,
    median_target: bool,
    stage: KeyStage,
    gate: f64,
    kv: usize,
    hd: usize,
    /// Probed layers, ascending, and the unedited pass's t* at each.
    layers: Vec<(usize, usize)>,
    images: Vec<ImageEdit>,
    /// The remove control: per image, per probed layer, the tokens the edit gated.
    gated: Option<Vec<Vec<Vec<usize>>>>,
    /// Per image, per probed layer: the positions edited.
    affected: Mutex<Vec<Vec<Vec<usize>>>>,
}

/// What [`Editor::new`] needs to know about the pass.
pub struct EditSetup<'s> {
    pub kind: EditKind,
    pub control: bool,
    pub median_target: bool,
    pub stage: KeyStage,
    pub gate: f64,
    pub seed: u64,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Probed layers ascending, each with the unedited pass's text sink.
    pub layers: Vec<(usize, usize)>,
    /// Each image's token positions.
    pub images: &'s [Vec<usize>],
    /// The remove control edits the tokens the edit gated (per image, per probed layer) rather
    /// than gating its own pass's keys, so that the two differ only in the direction.
    pub gated: Option<Vec<Vec<Vec<usize>>>>,
}

impl Editor {
    pub fn new(s: EditSetup) -> Editor {
        let (kv, hd) = (s.num_kv_heads, s.head_dim);
        let images = s
            .images
            .iter()
            .enumerate()
            .map(|(i, positions)| {
                let n = positions.len();
                let aligned = if s.kind == EditKind::Align {
                    SplitMix64::stream(s.seed, i, 0).pick(n, ALIGNED)
                } else {
                    Vec::new()
                };
                let random = match (s.control, s.kind) {
                    (true, EditKind::Remove) => {
                        let mut rng = SplitMix64::stream(s.seed, i, 1);
                        s.layers
                            .iter()
                            .map(|_| (0..kv).map(|_| unit(normals(&mut rng, hd))).collect())
                            .collect()
                    }
                    (true, EditKind::Align) => {
                        let mut rng = SplitMix64::stream(s.seed, i, 2);
                        s.layers
                            .iter()
                            .map(|_| {
                                (0..aligned.len() * kv)
                                    .map(|_| normals(&mut rng, hd))
                                    .collect()
                            })
                            .collect()
                    }
                    _ => Vec::new(),
                };
                ImageEdit {
                    positions: positions.clone(),
                    aligned,
                    random,
                }
            })
            .collect::<Vec<_>>();
        let affected = vec![vec![Vec::new(); s.layers.len()]; images.len()];
        Editor {
            kind: s.kind,
            control: s.control,
            median_target: s.median_target,
            stage: s.stage,
            gate: s.gate,
            kv,
            hd,
            layers: s.layers,
            images,
            gated: s.gated,
            affected: Mutex::new(affected),
        }
    }

    /// Per image, per probed layer: the positions edited so far.
    pub fn affected_now(&self) -> Vec<Vec<Vec<usize>>> {
        self.affected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The probed layers, ascending, each with its text sink t*.
    pub fn layers(&self) -> &[(usize, usize)] {
        &self.layers
    }

    /// Per image, per probed layer: the positions the pass edited.
    pub fn affected(self) -> Vec<Vec<Vec<usize>>> {
        self.affected
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
    }
}

fn normals(rng: &mut SplitMix64, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.normal()).collect()
}

/// `v / ‖v‖`; zero for a zero vector (a text-sink key equal to the mean edits nothing).
fn unit(v: Vec<f64>) -> Vec<f64> {
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if n == 0.0 {
        return v;
    }
    v.into_iter().map(|x| x / n).collect()
}

/// The median (the mean of the two middle values for an even count).
fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    let n = x.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        x[n / 2]
    } else {
        (x[n / 2 - 1] + x[n / 2]) / 2.0
    }
}

impl KeyEdit for Editor {
    fn stage(&self) -> KeyStage {
        self.stage
    }

    fn edit(&self, layer: usize, keys: &mut [f32]) -> Result<()> {
        let Some(li) = self.layers.iter().position(|&(l, _)| l == layer) else {
            return Ok(());
        };
        let sink = self.layers[li].1;
        let (kv, hd) = (self.kv, self.hd);
        let width = kv * hd;
        let slot = |j: usize, g: usize| j * width + g * hd..j * width + (g + 1) * hd;
        // Every image's μ, gate and direction come from this layer's keys before any edit.
        let original = keys.to_vec();
        let mut affected = self.affected.lock().unwrap_or_else(|e| e.into_inner());
        for (ii, image) in self.images.iter().enumerate() {
            let touched: Vec<usize> = match self.kind {
                EditKind::None => Vec::new(),
                EditKind::Remove => {
                    let mu = mean_keys(&original, &image.positions, kv, hd);
                    let gated: Vec<usize> = match &self.gated {
                        Some(g) => g[ii][li].clone(),
                        None => {
                            let cos =
                                centered_cosines(&original, &image.positions, sink, &mu, kv, hd);
                            image
                                .positions
                                .iter()
                                .zip(&cos)
                                .filter(|(_, &c)| c >= self.gate)
                                .map(|(&j, _)| j)
                                .collect()
                        }
                    };
                    for g in 0..kv {
                        let u = if self.control {
                            image.random[li][g].clone()
                        } else {
                            let d: Vec<f64> = original[slot(sink, g)]
                                .iter()
                                .zip(&mu[g])
                                .map(|(&k, &m)| k as f64 - m)
                                .collect();
                            unit(d)
                        };
                        let component = |j: usize| -> f64 {
                            original[slot(j, g)]
                                .iter()
                                .zip(&u)
                                .map(|(&k, &x)| k as f64 * x)
                                .sum()
                        };
                        let target = if self.median_target {
                            median(image.positions.iter().map(|&j| component(j)).collect())
                        } else {
                            0.0
                        };
                        for &j in &gated {
                            let shift = component(j) - target;
                            for (k, &x) in keys[slot(j, g)].iter_mut().zip(&u) {
                                *k = (*k as f64 - shift * x) as f32;
                            }
                        }
                    }
                    gated
                }
                EditKind::Align => {
                    let mut touched = Vec::new();
                    for (t, &idx) in image.aligned.iter().enumerate() {
                        let j = image.positions[idx];
                        for g in 0..kv {
                            let sink_key = &original[slot(sink, g)];
                            let new: Vec<f32> = if self.control {
                                let z = &image.random[li][t * kv + g];
                                let scale = sink_key
                                    .iter()
                                    .map(|&v| v as f64 * v as f64)
                                    .sum::<f64>()
                                    .sqrt()
                                    / z.iter().map(|v| v * v).sum::<f64>().sqrt();
                                z.iter().map(|&v| (v * scale) as f32).collect()
                            } else {
                                sink_key.to_vec()
                            };
                            keys[slot(j, g)].copy_from_slice(&new);
                        }
                        touched.push(j);
                    }
                    touched
                }
            };
            affected[ii][li] = touched;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_its_published_sequence() {
        // The first outputs from state 0 (Vigna's reference splitmix64.c).
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let picked = SplitMix64::stream(7, 0, 0).pick(20, 8);
        assert_eq!(picked.len(), 8);
        assert!(picked.windows(2).all(|w| w[0] < w[1]) && picked[7] < 20);
        assert_eq!(SplitMix64::stream(7, 0, 0).pick(3, 8), vec![0, 1, 2]);
        // Values the Python reference (tools/visual_sinks_ref.py) draws.
        assert_eq!(SplitMix64::stream(12345, 0, 0).0, 0xd1b5_4a32_d192_dd3a);
        assert_eq!(
            SplitMix64::stream(12345, 0, 0).pick(16, 8),
            vec![2, 4, 6, 7, 8, 9, 10, 12]
        );
        assert_eq!(
            SplitMix64::stream(99, 1, 0).pick(12, 8),
            vec![2, 3, 4, 5, 6, 8, 9, 10]
        );
        let mut normals = SplitMix64::stream(0, 0, 1);
        for want in [
            -0.43855412513511877,
            0.40399040548905857,
            0.6295126433454251,
        ] {
            assert!((normals.normal() - want).abs() < 1e-15);
        }
    }

    #[test]
    fn remove_projects_the_sink_direction_out_of_gated_keys() {
        // One KV head of width 2; t* at 0, image tokens 1..4. Token 1 points along the sink.
        let mut keys = vec![3.0, 0.0, 2.9, 0.1, 0.0, 1.0, 0.1, -1.0];
        let editor = Editor::new(EditSetup {
            kind: EditKind::Remove,
            control: false,
            median_target: false,
            stage: KeyStage::PreRope,
            gate: 0.5,
            seed: 0,
            num_kv_heads: 1,
            head_dim: 2,
            layers: vec![(0, 0)],
            images: &[vec![1, 2, 3]],
            gated: None,
        });
        editor.edit(0, &mut keys).unwrap();
        let mu = mean_keys(&[3.0, 0.0, 2.9, 0.1, 0.0, 1.0, 0.1, -1.0], &[1, 2, 3], 1, 2);
        let u = unit(vec![3.0 - mu[0][0], 0.0 - mu[0][1]]);
        let along = keys[2] as f64 * u[0] + keys[3] as f64 * u[1];
        assert!(along.abs() < 1e-6, "{along}");
        assert_eq!(&keys[4..], &[0.0, 1.0, 0.1, -1.0]);
        assert_eq!(editor.affected(), vec![vec![vec![1]]]);
    }
}
