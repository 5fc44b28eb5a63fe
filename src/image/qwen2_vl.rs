//! The Qwen2-VL image processor, also Qwen2.5-VL's and Qwen3-VL's:
//! `transformers/models/qwen2_vl/image_processing_pil_qwen2_vl.py`, step by step
//! (docs/reference/images.md, "Qwen2-VL").

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{decode, resize, Common, Grid, Pixels, ToFloat};
use crate::bail;
use crate::error::Result;

/// `size` in its newer form: the pixel-count bounds under transformers' names.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct PixelBounds {
    pub shortest_edge: Option<u64>,
    pub longest_edge: Option<u64>,
}

/// `preprocessor_config.json` as `Qwen2VLImageProcessorPil.__init__` reads it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Config {
    #[serde(flatten)]
    pub common: Common,
    #[serde(default = "patch_size")]
    pub patch_size: usize,
    #[serde(default = "two")]
    pub temporal_patch_size: usize,
    #[serde(default = "two")]
    pub merge_size: usize,
    pub size: Option<PixelBounds>,
    /// The legacy names; each overrides its `size` field, as `__init__` does.
    pub min_pixels: Option<u64>,
    pub max_pixels: Option<u64>,
}

fn patch_size() -> usize {
    14
}
fn two() -> usize {
    2
}

/// A Qwen2-VL family processor with its config resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2Vl {
    pub config: Config,
    pub min_pixels: u64,
    pub max_pixels: u64,
    to_float: ToFloat,
}

impl Qwen2Vl {
    /// Resolves the pixel bounds as `Qwen2VLImageProcessorPil.__init__` does: `size` (default
    /// `{shortest_edge: 56·56, longest_edge: 28·28·1280}`) with `min_pixels`/`max_pixels` over it.
    pub fn from_config(config: Config, path: &Path) -> Result<Self> {
        let size = config.size.unwrap_or(PixelBounds {
            shortest_edge: Some(56 * 56),
            longest_edge: Some(28 * 28 * 1280),
        });
        let min_pixels = config.min_pixels.or(size.shortest_edge);
        let max_pixels = config.max_pixels.or(size.longest_edge);
        let (Some(min_pixels), Some(max_pixels)) = (min_pixels, max_pixels) else {
            bail!(
                "{}: size needs both shortest_edge and longest_edge (or min_pixels and max_pixels)",
                path.display()
            );
        };
        let name = |legacy: Option<u64>, legacy_name, size_name| match legacy {
            Some(_) => legacy_name,
            None => size_name,
        };
        let min_name = name(config.min_pixels, "min_pixels", "size.shortest_edge");
        let max_name = name(config.max_pixels, "max_pixels", "size.longest_edge");
        if config.patch_size == 0 || config.merge_size == 0 || config.temporal_patch_size == 0 {
            bail!(
                "{}: patch_size, merge_size and temporal_patch_size must be positive",
                path.display()
            );
        }
        // The bounds that keep the resize and its output finite (docs/reference/images.md,
        // "Bounds"): no larger image than the decoder reads, a merged patch no larger than
        // that, and the f32 output within the `--pixel-values` cap.
        if max_pixels > decode::MAX_PIXELS {
            bail!(
                "{}: {max_name} {max_pixels} is more than the {} pixels an image may have \
                 (PIL's decompression-bomb limit)",
                path.display(),
                decode::MAX_PIXELS
            );
        }
        if min_pixels > max_pixels {
            bail!(
                "{}: {min_name} {min_pixels} is more than {max_name} {max_pixels}",
                path.display()
            );
        }
        let factor = config.patch_size.checked_mul(config.merge_size);
        if factor
            .and_then(|f| f.checked_mul(f))
            .is_none_or(|a| a as u64 > max_pixels)
        {
            bail!(
                "{}: patch_size {} · merge_size {} squared is more than {max_name} {max_pixels}: \
                 one merged patch would not fit the largest image",
                path.display(),
                config.patch_size,
                config.merge_size
            );
        }
        let output = (config.temporal_patch_size as u64)
            .checked_mul(max_pixels)
            .and_then(|v| v.checked_mul(3 * 4));
        if output.is_none_or(|bytes| bytes > crate::input::PIXEL_VALUES.bytes) {
            bail!(
                "{}: temporal_patch_size {} makes the output of a {max_name} {max_pixels} image \
                 larger than the {} a processor's output may be",
                path.display(),
                config.temporal_patch_size,
                crate::units::human_bytes(crate::input::PIXEL_VALUES.bytes)
            );
        }
        let to_float = ToFloat::new(&config.common, path)?;
        Ok(Qwen2Vl {
            config,
            min_pixels,
            max_pixels,
            to_float,
        })
    }

    /// `pixel_values [patches, 3·T·P·P]` and `image_grid_thw` for `images`, concatenated.
    pub fn preprocess(&self, images: &[PathBuf]) -> Result<Pixels> {
        let (p, m, t) = (
            self.config.patch_size,
            self.config.merge_size,
            self.config.temporal_patch_size,
        );
        let mut values = Vec::new();
        let mut grids = Vec::new();
        let mut tokens = Vec::new();
        for path in images {
            let image = decode::load_rgb(path, self.config.common.do_convert_rgb)?;
            let (height, width) = (image.height() as usize, image.width() as usize);
            let image = if self.config.common.do_resize {
                let (h, w) = smart_resize(height, width, p * m, self.min_pixels, self.max_pixels)
                    .map_err(|e| crate::bad!("{}: {e}", path.display()))?;
                resize::bicubic(&image, w as u32, h as u32)?
            } else if height % (p * m) != 0 || width % (p * m) != 0 {
                bail!(
                    "{}: {width}x{height} is not a multiple of patch_size·merge_size = {} and \
                     do_resize is false",
                    path.display(),
                    p * m
                );
            } else {
                image
            };
            let (h, w) = (image.height() as usize, image.width() as usize);
            let planes = self.to_float.planes(&image);
            patchify(&planes, h, w, p, m, t, &mut values);
            let grid = [1, h / p, w / p];
            tokens.push(grid.iter().product::<usize>() / (m * m));
            grids.push(grid);
        }
        let rows = grids.iter().map(|g| g[1] * g[2]).sum();
        Ok(Pixels {
            values,
            shape: vec![rows, 3 * t * p * p],
            grid: Grid::Thw(grids),
            tokens,
        })
    }
}

/// transformers' `smart_resize`: the size nearest `height`x`width` with both sides multiples of
/// `factor` and the area in `[min_pixels, max_pixels]`. Python's `round` rounds half to even.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> std::result::Result<(usize, usize), String> {
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(format!(
            "absolute aspect ratio must be smaller than 200, got {ratio:?}"
        ));
    }
    let mut h_bar = (h / f).round_ties_even() as usize * factor;
    let mut w_bar = (w / f).round_ties_even() as usize * factor;
    if (h_bar * w_bar) as u64 > max_pixels {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / f).floor() as usize * factor);
        w_bar = factor.max((w / beta / f).floor() as usize * factor);
    } else if ((h_bar * w_bar) as u64) < min_pixels {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() as usize * factor;
        w_bar = (w * beta / f).ceil() as usize * factor;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(format!(
            "{width}x{height} resizes to {w_bar}x{h_bar} (min_pixels is too small)"
        ));
    }
    Ok((h_bar, w_bar))
}

/// `patchify`'s reshape, transpose `(1, 4, 2, 5, 0, 3, 6)` and temporal broadcast, written as the
/// loops they amount to: rows run over merge blocks, then the patches within a block; each row is
/// `[channel][t][py][px]`, the T copies identical.
fn patchify(planes: &[f32], h: usize, w: usize, p: usize, m: usize, t: usize, out: &mut Vec<f32>) {
    let plane = h * w;
    let (blocks_h, blocks_w) = (h / (p * m), w / (p * m));
    out.reserve(3 * t * plane);
    for bh in 0..blocks_h {
        for bw in 0..blocks_w {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        for _ in 0..t {
                            for y in y0..y0 + p {
                                let start = c * plane + y * w + x0;
                                out.extend_from_slice(&planes[start..start + p]);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected values are transformers 5.23's smart_resize on the same arguments.
    #[test]
    fn smart_resize_rounds_half_to_even() {
        // 42/28 = 1.5 rounds to 2 and 70/28 = 2.5 rounds to 2: Python's round.
        assert_eq!(smart_resize(42, 70, 28, 0, u64::MAX), Ok((56, 56)));
        assert_eq!(smart_resize(98, 126, 28, 0, u64::MAX), Ok((112, 112)));
    }

    #[test]
    fn smart_resize_max_pixels_branch() {
        // 84x112 = 9408 > 4704: beta = sqrt(7500/4704), floor to multiples of 28.
        assert_eq!(smart_resize(75, 100, 28, 3920, 4704), Ok((56, 56)));
        // Never below one factor per side.
        assert_eq!(smart_resize(61, 150, 28, 3920, 4704), Ok((28, 84)));
        // The Qwen default bounds on a 1080p frame.
        assert_eq!(
            smart_resize(1080, 1920, 28, 56 * 56, 28 * 28 * 1280),
            Ok((728, 1316))
        );
    }

    #[test]
    fn smart_resize_min_pixels_branch() {
        // 56x56 = 3136 < 3920: beta = sqrt(3920/3072), ceil to multiples of 28.
        assert_eq!(smart_resize(48, 64, 28, 3920, 4704), Ok((56, 84)));
        assert_eq!(
            smart_resize(10, 10, 28, 56 * 56, 28 * 28 * 1280),
            Ok((56, 56))
        );
    }

    #[test]
    fn smart_resize_rejects_extreme_aspect_ratios() {
        assert!(smart_resize(1, 201, 28, 56 * 56, 28 * 28 * 1280)
            .unwrap_err()
            .contains("absolute aspect ratio must be smaller than 200, got 201.0"));
        // 200 is allowed: rounding gives 0x196, below min_pixels, so the min branch scales up.
        assert_eq!(
            smart_resize(1, 200, 28, 56 * 56, 28 * 28 * 1280),
            Ok((28, 812))
        );
    }

    #[test]
    fn patchify_orders_merge_blocks_then_patches() {
        // One channel value per pixel encodes (c, y, x); P = 1, M = 2, T = 2 on a 2x4 image.
        let (h, w) = (2, 4);
        let planes: Vec<f32> = (0..3 * h * w).map(|i| i as f32).collect();
        let mut out = Vec::new();
        patchify(&planes, h, w, 1, 2, 2, &mut out);
        // Row order: block (0,0): (0,0) (0,1) (1,0) (1,1); block (0,1): (0,2) (0,3) (1,2) (1,3).
        let firsts: Vec<f32> = out.chunks(6).map(|row| row[0]).collect();
        assert_eq!(firsts, [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]);
        // Each row: channel-major, each channel's value twice (T = 2).
        assert_eq!(&out[..6], &[0.0, 0.0, 8.0, 8.0, 16.0, 16.0]);
    }
}
