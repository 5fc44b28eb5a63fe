"""Writes tests/fixtures/jpeg/: small JPEGs in each chroma subsampling and coding mode PIL writes,
and beside each, as a PNG, the RGB that transformers' `load_image` gets from it with Pillow 13
(libjpeg-turbo 3.2: `ImageOps.exif_transpose`, then `convert("RGB")`). tests/image.rs requires
sinkmerge's decoding to equal these bytes (docs/reference/images.md, "JPEG").

Content: smooth gradients, hard coloured edges and seeded noise, so that chroma upsampling,
the IDCT's rounding and colour conversion all show; odd sizes, so that the last block column and
row are partial and the upsampler's edge cases run.

    tools/.venv/bin/python tools/gen_jpeg_goldens.py
"""

import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageOps

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "jpeg"


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = random.Random(seed)
    img = Image.new("RGB", (width, height))
    px = img.load()
    for y in range(height):
        for x in range(width):
            noise = rng.randrange(-12, 13)
            px[x, y] = (
                max(0, min(255, x * 255 // max(width - 1, 1) + noise)),
                max(0, min(255, 200 - y * 150 // max(height - 1, 1) + noise)),
                max(0, min(255, 60 + (x + y) * 3 % 180 - noise)),
            )
    draw = ImageDraw.Draw(img)
    draw.rectangle([width // 6, height // 5, width // 2, height // 2], fill=(230, 20, 40))
    draw.ellipse([width // 2, height // 3, max(width - 3, width // 2), max(height - 4, height // 3)], fill=(20, 40, 220))
    draw.line([0, height - 1, width - 1, 0], fill=(250, 250, 0), width=2)
    return img


# name: (size, save options). PIL's subsampling 0, 1, 2 are 4:4:4, 4:2:2, 4:2:0.
CASES = {
    "s444_61x43": ((61, 43), {"quality": 90, "subsampling": 0}),
    "s422_61x43": ((61, 43), {"quality": 90, "subsampling": 1}),
    "s420_61x43": ((61, 43), {"quality": 90, "subsampling": 2}),
    "s420_q75_61x43": ((61, 43), {"quality": 75, "subsampling": 2}),
    "progressive_61x43": ((61, 43), {"quality": 90, "subsampling": 2, "progressive": True}),
    "progressive_s444_61x43": (
        (61, 43),
        {"quality": 80, "subsampling": 0, "progressive": True, "optimize": True},
    ),
    "restart_61x43": ((61, 43), {"quality": 90, "subsampling": 2, "restart_marker_blocks": 3}),
    # Chroma 2 samples wide: libjpeg-turbo replicates instead of filtering (jdsample.c).
    "s420_3x5": ((3, 5), {"quality": 90, "subsampling": 2}),
    "grey_37x29": ((37, 29), {"quality": 85}),
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, (name, (size, options)) in enumerate(CASES.items()):
        img = picture(*size, seed)
        if name.startswith("grey"):
            img = img.convert("L")
        path = OUT / f"{name}.jpg"
        img.save(path, **options)
        with Image.open(path) as decoded:
            rgb = ImageOps.exif_transpose(decoded).convert("RGB")
        rgb.save(OUT / f"{name}.png", optimize=True)


if __name__ == "__main__":
    main()
