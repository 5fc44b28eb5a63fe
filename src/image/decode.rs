//! Image files to RGB8, as transformers' `load_image` (`transformers/image_utils.py`) hands them to
//! a processor: EXIF orientation applied (`ImageOps.exif_transpose`), then PIL's
//! `Image.convert("RGB")`, then the processor's own `convert_to_rgb`
//! (`transformers/image_transforms.py`), which only whitens a transparent key colour by then
//! (docs/reference/images.md, "Decoding").

use std::io::Cursor;
use std::path::Path;

use ::image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, ImageReader, Limits, RgbImage};

use crate::error::{Error, Result};
use crate::{bad, bail};

mod jpeg;

/// The largest image decoded, in pixels: PIL's `DecompressionBombError` threshold (twice its
/// `MAX_IMAGE_PIXELS`, 89,478,485), so that sinkmerge refuses what PIL refuses.
pub const MAX_PIXELS: u64 = 2 * 89_478_485;

/// The most memory the decoder may allocate: `MAX_PIXELS` at 16-bit RGBA, 8 bytes a pixel.
const MAX_ALLOC: u64 = MAX_PIXELS * 8;

/// Decodes a PNG, JPEG or WebP file to RGB8 as `load_image` then `convert_to_rgb` do. With
/// `convert_rgb` false (a processor's `do_convert_rgb: false`) the second step is skipped, so a
/// `tRNS` key colour stays as it is; `load_image`'s own `convert("RGB")` always runs.
pub fn load_rgb(path: &Path, convert_rgb: bool) -> Result<RgbImage> {
    let bytes = crate::input::read(path, crate::input::IMAGE)?;
    let keyed = png_transparency_key(&bytes);
    let mut reader = ImageReader::new(Cursor::new(&bytes[..]))
        .with_guessed_format()
        .map_err(|e| Error::read(path, e))?;
    if reader.format().is_none() {
        // Unrecognised content: decode as the extension says, for an error about that format.
        if let Ok(format) = ImageFormat::from_path(path) {
            reader.set_format(format);
        }
    }
    let is_jpeg = reader.format() == Some(ImageFormat::Jpeg);
    if is_jpeg && jpeg_truncated(&bytes) {
        bail!(
            "{}: the JPEG is truncated (its data ends before the end-of-image marker); PIL \
             refuses it too (\"image file is truncated\")",
            path.display()
        );
    }
    let mut limits = Limits::default();
    limits.max_alloc = Some(MAX_ALLOC);
    reader.limits(limits);
    let mut decoder = reader.into_decoder().map_err(|e| decode_error(path, e))?;
    let (width, height) = decoder.dimensions();
    if width == 0 || height == 0 {
        bail!("{}: the image is {width}x{height} pixels", path.display());
    }
    if u64::from(width) * u64::from(height) > MAX_PIXELS {
        bail!(
            "{}: {width}x{height} pixels is more than the {MAX_PIXELS} allowed (PIL's decompression-bomb limit)",
            path.display()
        );
    }
    let orientation = decoder.orientation().map_err(|e| decode_error(path, e))?;
    // JPEG: libjpeg-turbo's arithmetic, PIL's decoder, where jpeg.rs covers the file; the image
    // crate's decoder (zune-jpeg) otherwise.
    let exact = is_jpeg
        .then(|| jpeg::decode(&bytes))
        .flatten()
        .filter(|image| image.width() == width && image.height() == height);
    let mut image = match exact {
        Some(image) => image,
        None => DynamicImage::from_decoder(decoder).map_err(|e| decode_error(path, e))?,
    };
    image.apply_orientation(orientation);
    to_rgb8(image, keyed && convert_rgb, path)
}

/// Whether a JPEG ends before its end-of-image marker (EOI, `FF D9`). libjpeg-turbo stops early
/// on such a file and PIL then raises "image file is truncated"; zune-jpeg pads the missing data
/// and answers. The walk follows the marker segments by their lengths and each scan's
/// entropy-coded data to the next marker (an `FF` inside that data is stuffed as `FF 00`, or is a
/// restart marker or fill), so an EOI inside an EXIF thumbnail's segment is never taken for the
/// file's own (ITU T.81, B.1.1).
fn jpeg_truncated(bytes: &[u8]) -> bool {
    let mut i = 2; // past SOI
    loop {
        // The next marker: its FF, any fill FFs, then the marker code.
        while bytes.get(i).is_some_and(|&b| b != 0xFF) {
            i += 1;
        }
        while bytes.get(i) == Some(&0xFF) {
            i += 1;
        }
        let Some(&marker) = bytes.get(i) else {
            return true;
        };
        i += 1;
        match marker {
            0xD9 => return false,
            // Standalone markers: no length.
            0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        let Some(length) = bytes.get(i..i + 2) else {
            return true;
        };
        i += usize::from(u16::from_be_bytes([length[0], length[1]]));
        if i > bytes.len() {
            return true;
        }
        if marker == 0xDA {
            // The scan's entropy-coded data runs to the next marker that is not stuffing or RSTn.
            loop {
                while bytes.get(i).is_some_and(|&b| b != 0xFF) {
                    i += 1;
                }
                match bytes.get(i + 1) {
                    None => return true,
                    Some(0x00 | 0xD0..=0xD7) => i += 2,
                    Some(0xFF) => i += 1,
                    Some(_) => break,
                }
            }
        }
    }
}

fn decode_error(path: &Path, err: ImageError) -> Error {
    match err {
        ImageError::Unsupported(e) => bad!(
            "{}: unsupported image format (sinkmerge reads PNG, JPEG and WebP): {e}",
            path.display()
        ),
        ImageError::Limits(e) => bad!("{}: image over the decoding limits: {e}", path.display()),
        e => bad!(
            "{}: cannot decode the image (corrupt or truncated?): {e}",
            path.display()
        ),
    }
}

/// Whether the file is a PNG without an alpha channel whose `tRNS` chunk marks one colour (grey,
/// RGB) or one palette entry fully transparent. The decoder turns that key into alpha; PIL keeps it
/// as `info["transparency"]` through `convert("RGB")`, and transformers' `convert_to_rgb` then
/// composites the key colour onto white. A palette `tRNS` with partial alpha PIL drops instead.
fn png_transparency_key(bytes: &[u8]) -> bool {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    let Some(mut rest) = bytes.strip_prefix(SIGNATURE) else {
        return false;
    };
    let mut color_type = None;
    while rest.len() >= 8 {
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let (kind, body) = (&rest[4..8], &rest[8..]);
        let Some(data) = body.get(..len) else {
            return false;
        };
        match kind {
            b"IHDR" => color_type = data.get(9).copied(),
            b"tRNS" => {
                return match color_type {
                    Some(0 | 2) => true,
                    // PngImagePlugin's `_simple_palette`: one 0 entry, every other 255.
                    Some(3) => {
                        data.iter().filter(|&&a| a == 0).count() == 1
                            && data.iter().all(|&a| a == 0 || a == 255)
                    }
                    _ => false,
                };
            }
            b"IDAT" => return false,
            _ => {}
        }
        rest = body.get(len + 4..).unwrap_or_default();
    }
    false
}

/// PIL's `convert("RGB")` per decoded layout (checked against Pillow 13 in
/// docs/reference/images.md): alpha dropped, not composited; grey replicated; 16-bit colour keeps
/// the high byte (PIL decodes it to 8 bits that way); 16-bit grey (`I;16`) clips at 255.
fn to_rgb8(image: DynamicImage, keyed: bool, path: &Path) -> Result<RgbImage> {
    let (width, height) = (image.width(), image.height());
    // Each source pixel to RGB and whether it is the transparent key colour.
    let pixels: Vec<([u8; 3], bool)> = match image {
        DynamicImage::ImageRgb8(img) => return Ok(img),
        DynamicImage::ImageRgba8(img) => img
            .pixels()
            .map(|p| ([p[0], p[1], p[2]], p[3] == 0))
            .collect(),
        DynamicImage::ImageLuma8(img) => img.pixels().map(|p| ([p[0]; 3], false)).collect(),
        DynamicImage::ImageLumaA8(img) => img.pixels().map(|p| ([p[0]; 3], p[1] == 0)).collect(),
        DynamicImage::ImageRgb16(img) => img
            .pixels()
            .map(|p| (p.0.map(|v| (v >> 8) as u8), false))
            .collect(),
        DynamicImage::ImageRgba16(img) => img
            .pixels()
            .map(|p| ([p[0], p[1], p[2]].map(|v| (v >> 8) as u8), p[3] == 0))
            .collect(),
        DynamicImage::ImageLuma16(img) => img
            .pixels()
            .map(|p| ([p[0].min(255) as u8; 3], false))
            .collect(),
        DynamicImage::ImageLumaA16(img) => img
            .pixels()
            .map(|p| ([(p[0] >> 8) as u8; 3], p[1] == 0))
            .collect(),
        other => bail!(
            "{}: unsupported pixel layout {:?}",
            path.display(),
            other.color()
        ),
    };
    let mut out = RgbImage::new(width, height);
    for (dst, (rgb, transparent)) in out.pixels_mut().zip(pixels) {
        dst.0 = if keyed && transparent { [255; 3] } else { rgb };
    }
    Ok(out)
}
