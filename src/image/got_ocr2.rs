//! InternVL's image processor, GotOcr2's dynamic tiling:
//! `transformers/models/got_ocr2/image_processing_pil_got_ocr2.py`, step by step
//! (docs/reference/images.md, "InternVL").

use std::path::{Path, PathBuf};

use ::image::RgbImage;
use serde::Deserialize;

use super::{decode, resize, Common, Grid, Pixels, ToFloat};
use crate::bail;
use crate::error::Result;

/// The tile size, `size: {height, width}`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct TileSize {
    pub height: usize,
    pub width: usize,
}

/// `preprocessor_config.json` as `GotOcr2ImageProcessorPil` reads it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Config {
    #[serde(flatten)]
    pub common: Common,
    #[serde(default = "tile_size")]
    pub size: TileSize,
    #[serde(default)]
    pub crop_to_patches: bool,
    #[serde(default = "one")]
    pub min_patches: usize,
    #[serde(default = "twelve")]
    pub max_patches: usize,
}

fn tile_size() -> TileSize {
    TileSize {
        height: 384,
        width: 384,
    }
}
fn one() -> usize {
    1
}
fn twelve() -> usize {
    12
}

/// The most tiles an image is cut into: the tiling looks at max_patches² grids, and 256 is over
/// 20 times the processor's default of 12.
pub const MAX_PATCHES: usize = 256;

/// A GotOcr2 processor with its config checked.
#[derive(Debug, Clone, PartialEq)]
pub struct GotOcr2 {
    pub config: Config,
    /// Tokens per tile: see [`super::InternVl`].
    pub image_seq_length: usize,
    to_float: ToFloat,
}

impl GotOcr2 {
    pub fn from_config(config: Config, image_seq_length: usize, path: &Path) -> Result<Self> {
        let TileSize { height, width } = config.size;
        if height == 0 || width == 0 {
            bail!(
                "{}: size.height and size.width must be positive",
                path.display()
            );
        }
        // The bounds that keep the tiling and its output finite (docs/reference/images.md,
        // "Bounds"): a tile and the canvas of tiles no larger than the decoder reads, and the
        // grids looked at (max_patches² of them) few.
        let tile = height.checked_mul(width).map(|a| a as u64);
        if tile.is_none_or(|a| a > decode::MAX_PIXELS) {
            bail!(
                "{}: size {width}x{height} is more than the {} pixels an image may have \
                 (PIL's decompression-bomb limit)",
                path.display(),
                decode::MAX_PIXELS
            );
        }
        let tile = tile.unwrap_or(u64::MAX);
        if config.min_patches == 0 || config.min_patches > config.max_patches {
            bail!(
                "{}: min_patches {} must be at least 1 and at most max_patches {}",
                path.display(),
                config.min_patches,
                config.max_patches
            );
        }
        let canvas = (config.max_patches as u64).checked_mul(tile);
        if config.max_patches > MAX_PATCHES || canvas.is_none_or(|a| a > decode::MAX_PIXELS) {
            bail!(
                "{}: max_patches {} is more than {MAX_PATCHES}, or its canvas of {width}x{height} \
                 tiles more than the {} pixels an image may have",
                path.display(),
                config.max_patches,
                decode::MAX_PIXELS
            );
        }
        let to_float = ToFloat::new(&config.common, path)?;
        Ok(GotOcr2 {
            config,
            image_seq_length,
            to_float,
        })
    }

    /// `pixel_values [tiles, 3, H, W]` and `num_patches` for `images`, concatenated.
    pub fn preprocess(&self, images: &[PathBuf]) -> Result<Pixels> {
        let TileSize { height, width } = self.config.size;
        let mut values = Vec::new();
        let mut num_patches = Vec::new();
        for path in images {
            let image = decode::load_rgb(path, self.config.common.do_convert_rgb)?;
            // `_preprocess`: tiling ignores do_resize; a single tile resizes only with it.
            let tiles = if self.config.crop_to_patches && self.config.max_patches > 1 {
                self.crop_to_patches(&image)?
            } else if self.config.common.do_resize {
                vec![resize::bicubic(&image, width as u32, height as u32)?]
            } else if image.dimensions() != (width as u32, height as u32) {
                bail!(
                    "{}: {}x{} is not the tile size {width}x{height} and do_resize is false",
                    path.display(),
                    image.width(),
                    image.height()
                );
            } else {
                vec![image]
            };
            num_patches.push(tiles.len());
            for tile in &tiles {
                values.extend(self.to_float.planes(tile));
            }
        }
        let total = num_patches.iter().sum();
        Ok(Pixels {
            values,
            shape: vec![total, 3, height, width],
            tokens: num_patches
                .iter()
                .map(|n| n * self.image_seq_length)
                .collect(),
            grid: Grid::NumPatches(num_patches),
        })
    }

    /// The (columns, rows) grid of tiles an image of `width`×`height` pixels is cut into: (1, 1)
    /// when it is one tile.
    pub fn tile_grid(&self, width: usize, height: usize) -> (usize, usize) {
        if self.config.crop_to_patches && self.config.max_patches > 1 {
            let TileSize {
                height: th,
                width: tw,
            } = self.config.size;
            optimal_tiled_canvas(
                (height, width),
                (th, tw),
                self.config.min_patches,
                self.config.max_patches,
            )
        } else {
            (1, 1)
        }
    }

    /// `crop_image_to_patches`: resize to the chosen grid of tiles, cut it row by row, and add
    /// the whole image resized to one tile when there is more than one.
    fn crop_to_patches(&self, image: &RgbImage) -> Result<Vec<RgbImage>> {
        let TileSize { height, width } = self.config.size;
        let (columns, rows) = self.tile_grid(image.width() as usize, image.height() as usize);
        let canvas = resize::bicubic(image, (width * columns) as u32, (height * rows) as u32)?;
        let mut tiles: Vec<RgbImage> = (0..columns * rows)
            .map(|i| {
                let (x, y) = ((i % columns) * width, (i / columns) * height);
                ::image::imageops::crop_imm(
                    &canvas,
                    x as u32,
                    y as u32,
                    width as u32,
                    height as u32,
                )
                .to_image()
            })
            .collect();
        if tiles.len() != 1 {
            tiles.push(resize::bicubic(image, width as u32, height as u32)?);
        }
        Ok(tiles)
    }
}

/// `get_all_supported_aspect_ratios`: every (columns, rows) with a tile count in
/// `[min_tiles, max_tiles]`, columns-major, then stably sorted by tile count.
fn supported_grids(min_tiles: usize, max_tiles: usize) -> Vec<(usize, usize)> {
    let mut grids: Vec<(usize, usize)> = (1..=max_tiles)
        .flat_map(|c| (1..=max_tiles).map(move |r| (c, r)))
        .filter(|&(c, r)| (min_tiles..=max_tiles).contains(&(c * r)))
        .collect();
    grids.sort_by_key(|&(c, r)| c * r);
    grids
}

/// `get_optimal_tiled_canvas`: the (columns, rows) whose aspect ratio is closest to the image's;
/// on a tie the later grid (more tiles) wins while the image's area is over half the tiles'.
/// (1, 1) when no grid fits the bounds.
fn optimal_tiled_canvas(
    (image_h, image_w): (usize, usize),
    (tile_h, tile_w): (usize, usize),
    min_tiles: usize,
    max_tiles: usize,
) -> (usize, usize) {
    let aspect_ratio = image_w as f64 / image_h as f64;
    let area = (image_w * image_h) as f64;
    let mut best_diff = f64::INFINITY;
    let mut best = (1, 1);
    for (c, r) in supported_grids(min_tiles, max_tiles) {
        let diff = (aspect_ratio - c as f64 / r as f64).abs();
        if diff < best_diff {
            best_diff = diff;
            best = (c, r);
        } else if diff == best_diff && area > 0.5 * (tile_h * tile_w * c * r) as f64 {
            best = (c, r);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_grids_match_transformers_docstring() {
        // get_all_supported_aspect_ratios(1, 4)'s documented value.
        assert_eq!(
            supported_grids(1, 4),
            [
                (1, 1),
                (1, 2),
                (2, 1),
                (1, 3),
                (3, 1),
                (1, 4),
                (2, 2),
                (4, 1)
            ]
        );
    }

    // Expected grids are transformers 5.23's get_optimal_tiled_canvas on the same arguments.
    #[test]
    fn grid_closest_aspect_ratio() {
        assert_eq!(optimal_tiled_canvas((75, 100), (28, 28), 1, 6), (3, 2));
        assert_eq!(optimal_tiled_canvas((61, 150), (28, 28), 1, 6), (2, 1));
        assert_eq!(optimal_tiled_canvas((131, 45), (28, 28), 1, 6), (1, 3));
        assert_eq!(optimal_tiled_canvas((500, 1000), (448, 448), 1, 12), (2, 1));
    }

    #[test]
    fn grid_ties_favour_more_tiles_only_for_large_images() {
        // A square ties (1,1) with (2,2): 100x100 is over half of four 28 px tiles, not of 448 px.
        assert_eq!(optimal_tiled_canvas((100, 100), (28, 28), 1, 6), (2, 2));
        assert_eq!(optimal_tiled_canvas((100, 100), (448, 448), 1, 12), (1, 1));
        assert_eq!(optimal_tiled_canvas((100, 100), (28, 28), 2, 6), (2, 2));
    }

    #[test]
    fn grid_defaults_to_one_tile_when_none_fits() {
        assert_eq!(optimal_tiled_canvas((100, 100), (28, 28), 7, 6), (1, 1));
    }
}
