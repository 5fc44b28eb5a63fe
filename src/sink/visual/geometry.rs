//! Where each image token sits in the original image (`docs/reference/visual-sinks.md`, "The
//! box"): the region it covers, in the image's pixels before any resize.

use crate::bail;
use crate::error::Result;

/// How an image's tokens tile it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenLayout {
    /// Qwen-VL: the `(t, h, w)` patch grid merged `merge`×`merge`; tokens frame by frame,
    /// row-major.
    Patches { grid: [usize; 3], merge: usize },
    /// InternVL: a `columns`×`rows` grid of tiles (row-major), then a thumbnail of the whole
    /// image when there is more than one tile; each tile a `side`×`side` token grid.
    Tiles {
        columns: usize,
        rows: usize,
        tiles: usize,
        side: usize,
    },
}

/// A token's region `[x0, y0, x1, y1]` in the original image's pixels, and whether it belongs
/// to the thumbnail (InternVL's overview tile, drawn under the tiles in a heatmap).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenRegion {
    pub rect: [f64; 4],
    pub thumbnail: bool,
}

impl TokenRegion {
    /// Whether the region's centre is in `b` (closed).
    pub fn centre_in(&self, b: &[f64; 4]) -> bool {
        let cx = (self.rect[0] + self.rect[2]) / 2.0;
        let cy = (self.rect[1] + self.rect[3]) / 2.0;
        b[0] <= cx && cx <= b[2] && b[1] <= cy && cy <= b[3]
    }
}

/// Every token's region for an image of `width`×`height` pixels, in token order; `tokens` is
/// the image's token count, checked against the layout.
pub fn token_regions(
    layout: TokenLayout,
    width: usize,
    height: usize,
    tokens: usize,
) -> Result<Vec<TokenRegion>> {
    let (w, h) = (width as f64, height as f64);
    let cells = |x0: f64, y0: f64, cw: f64, ch: f64, cols: usize, rows: usize, thumb: bool| {
        (0..rows).flat_map(move |r| {
            (0..cols).map(move |c| TokenRegion {
                rect: [
                    x0 + c as f64 * cw,
                    y0 + r as f64 * ch,
                    x0 + (c + 1) as f64 * cw,
                    y0 + (r + 1) as f64 * ch,
                ],
                thumbnail: thumb,
            })
        })
    };
    let regions: Vec<TokenRegion> = match layout {
        TokenLayout::Patches {
            grid: [t, gh, gw],
            merge,
        } => {
            let (cols, rows) = (gw / merge, gh / merge);
            let frame: Vec<TokenRegion> = cells(
                0.0,
                0.0,
                w / cols as f64,
                h / rows as f64,
                cols,
                rows,
                false,
            )
            .collect();
            (0..t).flat_map(|_| frame.iter().copied()).collect()
        }
        TokenLayout::Tiles {
            columns,
            rows,
            tiles,
            side,
        } => {
            let expected = columns * rows + usize::from(columns * rows > 1);
            if tiles != expected {
                bail!(
                    "the image has {tiles} tiles but its size {width}x{height} gives a \
                     {columns}x{rows} grid ({expected} tiles with the thumbnail)"
                );
            }
            let (tw, th) = (w / columns as f64, h / rows as f64);
            let (sw, sh) = (tw / side as f64, th / side as f64);
            let mut all = Vec::with_capacity(tiles * side * side);
            for k in 0..columns * rows {
                let (x0, y0) = ((k % columns) as f64 * tw, (k / columns) as f64 * th);
                all.extend(cells(x0, y0, sw, sh, side, side, false));
            }
            if tiles > 1 {
                let (sw, sh) = (w / side as f64, h / side as f64);
                all.extend(cells(0.0, 0.0, sw, sh, side, side, true));
            }
            all
        }
    };
    if regions.len() != tokens {
        bail!(
            "the image has {tokens} tokens but its layout {layout:?} gives {}",
            regions.len()
        );
    }
    Ok(regions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_tokens_cover_the_image_row_major() {
        let layout = TokenLayout::Patches {
            grid: [1, 4, 6],
            merge: 2,
        };
        let r = token_regions(layout, 300, 100, 6).unwrap();
        assert_eq!(r[0].rect, [0.0, 0.0, 100.0, 50.0]);
        assert_eq!(r[4].rect, [100.0, 50.0, 200.0, 100.0]);
        assert!(r[4].centre_in(&[120.0, 60.0, 180.0, 90.0]));
        assert!(!r[4].centre_in(&[0.0, 0.0, 149.0, 100.0]));
        assert!(token_regions(layout, 300, 100, 5).is_err());
    }

    #[test]
    fn internvl_tiles_then_the_thumbnail() {
        let layout = TokenLayout::Tiles {
            columns: 2,
            rows: 1,
            tiles: 3,
            side: 2,
        };
        let r = token_regions(layout, 200, 100, 12).unwrap();
        // Tile 1 (right half), its token (row 1, col 0).
        assert_eq!(r[6].rect, [100.0, 50.0, 150.0, 100.0]);
        assert!(r[8].thumbnail && !r[7].thumbnail);
        assert_eq!(r[11].rect, [100.0, 50.0, 200.0, 100.0]);
        let wrong = TokenLayout::Tiles {
            columns: 2,
            rows: 1,
            tiles: 2,
            side: 2,
        };
        assert!(token_regions(wrong, 200, 100, 8).is_err());
    }
}
