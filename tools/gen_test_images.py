"""Writes tests/fixtures/images/: small deterministic test images whose sizes force the
processors to resize (none is a multiple of 28 or 32) and InternVL to tile (wide and tall aspect
ratios). Content: smooth gradients plus hard edges and text-like strokes, so that both the
resampling filter's smooth response and its ringing at edges are exercised.

    tools/.venv/bin/python tools/gen_test_images.py
"""

from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "images"


def scene(width: int, height: int, seed: int) -> Image.Image:
    img = Image.new("RGB", (width, height))
    px = img.load()
    for y in range(height):
        for x in range(width):
            px[x, y] = (
                (x * 255 // max(width - 1, 1) + seed * 37) % 256,
                (y * 255 // max(height - 1, 1) + seed * 91) % 256,
                ((x ^ y) * 7 + seed * 13) % 256,
            )
    draw = ImageDraw.Draw(img)
    draw.rectangle([width // 5, height // 4, width // 2, height * 3 // 4], fill=(250, 250, 250))
    draw.ellipse([width // 2, height // 5, width * 9 // 10, height // 2], fill=(10, 20, 200))
    for i in range(0, width, 9):
        draw.line([i, 0, width - 1 - i // 2, height - 1], fill=(0, 0, 0), width=1)
    return img


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    # 100x75 PNG: 4:3, resized up to the processors' minimum grids.
    scene(100, 75, 1).save(OUT / "scene_100x75.png", optimize=False)
    # 150x61 JPEG: wide, several InternVL tiles.
    scene(150, 61, 2).save(OUT / "wide_150x61.jpg", quality=92, subsampling=0)
    # 45x131 WebP (lossless): tall, several tiles the other way.
    scene(45, 131, 3).save(OUT / "tall_45x131.webp", lossless=True)
    # 64x48 RGBA PNG: transformers' load_image drops the alpha (convert("RGB")), as trace does.
    rgba = scene(64, 48, 4).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((64, 48)))
    rgba.save(OUT / "alpha_64x48.png", optimize=False)


if __name__ == "__main__":
    main()
