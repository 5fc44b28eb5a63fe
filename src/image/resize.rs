//! PIL's `Image.resize(size, BICUBIC)` on RGB8, through `fast_image_resize`'s convolution with the
//! Catmull-Rom kernel (a = -0.5, support 2, widened by the scale when downscaling), which is PIL's
//! bicubic filter (`src/libImaging/Resample.c`). Parity with PIL is measured in
//! docs/reference/images.md, "Resampling".

use ::image::RgbImage;
use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::error::Result;
use crate::internal;

/// `image` resized to `width`x`height` with PIL's bicubic filter. As PIL, one axis is resampled,
/// rounded and clipped to uint8, then the other: the order matters where the kernel's overshoot
/// clips. Pillow 13 runs the vertical pass first when the height shrinks by more than twice as
/// many pixels as the width, else the horizontal one (docs/reference/images.md, "Resampling").
/// `fast_image_resize` picks its own order when both axes change, so the passes are two calls
/// here. The same size returns a copy, as PIL does.
pub fn bicubic(image: &RgbImage, width: u32, height: u32) -> Result<RgbImage> {
    let (in_w, in_h) = image.dimensions();
    let vertical_first =
        in_h > height && i64::from(in_h - height) > 2 * (i64::from(in_w) - i64::from(width));
    if vertical_first {
        one_pass(&one_pass(image, in_w, height)?, width, height)
    } else {
        one_pass(&one_pass(image, width, in_h)?, width, height)
    }
}

/// One `fast_image_resize` call; with one axis changed it is one convolution pass.
fn one_pass(image: &RgbImage, width: u32, height: u32) -> Result<RgbImage> {
    if image.dimensions() == (width, height) {
        return Ok(image.clone());
    }
    let src = ImageRef::new(
        image.width(),
        image.height(),
        image.as_raw(),
        PixelType::U8x3,
    )
    .map_err(|e| internal!("bicubic resize: the source buffer: {e}"))?;
    let mut dst = Image::new(width, height, PixelType::U8x3);
    let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
    Resizer::new()
        .resize(&src, &mut dst, &options)
        .map_err(|e| internal!("bicubic resize to {width}x{height}: {e}"))?;
    RgbImage::from_raw(width, height, dst.into_vec())
        .ok_or_else(|| internal!("bicubic resize: the output buffer has the wrong size"))
}
