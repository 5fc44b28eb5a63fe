"""Writes tests/fixtures/image/: the image processors' outputs that `src/image/` must reproduce
(docs/reference/images.md). For each processor config below, the config itself
(`<name>/preprocessor_config.json`, read by `image::Processor::from_dir`) and one safetensors per
test image of tests/fixtures/images/ (`<name>/<image stem>.safetensors`) with `pixel_values`
(float32) and `image_grid_thw` or `num_patches` (int64), made by transformers' PIL backends
(`Qwen2VLImageProcessorPil`, `GotOcr2ImageProcessorPil`) explicitly, on images loaded with
`transformers.image_utils.load_image` as a processor's caller would.

The sizes are small on purpose (the fixtures stay under ~1 MB) and chosen so the three branches of
`smart_resize` all occur: `qwen2_vl` scales `alpha_64x48` up through `min_pixels` and the other
three down through `max_pixels`; `qwen3_vl` (the newer `size` form, patch 16, mean/std 0.5) keeps
two images at their rounded size; `internvl` tiles into 3, 4 and 7 tiles of 28 px, and also runs
two decoding cases of inputs/ (EXIF orientation, a tRNS key colour); `internvl_keep_key` runs the
tRNS case with `do_convert_rgb` false.

    tools/.venv/bin/python tools/gen_image_goldens.py
"""

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors.numpy import save_file
from transformers.image_utils import load_image
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "tests" / "fixtures" / "images"
OUT = ROOT / "tests" / "fixtures" / "image"
# Two decoding cases of our own, processed by the `internvl` config only.
INPUTS = OUT / "inputs"

sys.path.insert(0, str(ROOT / "tools"))
from gen_test_images import scene  # noqa: E402

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]

CONFIGS = {
    # Qwen2-VL / Qwen2.5-VL: the legacy min_pixels/max_pixels fields, CLIP mean/std.
    "qwen2_vl": {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 0.00392156862745098,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "resample": 3,
        "min_pixels": 28 * 28 * 5,
        "max_pixels": 28 * 28 * 6,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    },
    # Qwen3-VL: the `size` form, patch 16, mean/std 0.5.
    "qwen3_vl": {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 0.00392156862745098,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 4},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    },
    # InternVL (-hf): GotOcr2 tiling with 28 px tiles (448 in the real models), ImageNet mean/std.
    "internvl": {
        "image_processor_type": "GotOcr2ImageProcessorFast",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 0.00392156862745098,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": IMAGENET_MEAN,
        "image_std": IMAGENET_STD,
        "resample": 3,
        "size": {"height": 28, "width": 28},
        "crop_to_patches": True,
        "min_patches": 1,
        "max_patches": 6,
    },
}
# do_convert_rgb false skips convert_to_rgb, so the tRNS key colour is not whitened (load_image's
# convert("RGB") still runs): the tRNS input only.
CONFIGS["internvl_keep_key"] = {**CONFIGS["internvl"], "do_convert_rgb": False}


def processor(config: dict):
    kwargs = {k: v for k, v in config.items() if k != "image_processor_type"}
    if config["image_processor_type"].startswith("Qwen2VL"):
        return Qwen2VLImageProcessorPil(**kwargs)
    return GotOcr2ImageProcessorPil(**kwargs)


def write_inputs() -> list[Path]:
    """An EXIF orientation (6: rotate 90 degrees clockwise), which `load_image` applies, and an RGB
    PNG with a tRNS key colour, which `convert_to_rgb` composites onto white."""
    INPUTS.mkdir(parents=True, exist_ok=True)
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = INPUTS / "exif_orientation6_40x30.png"
    scene(40, 30, 5).save(rotated, exif=exif, optimize=False)
    keyed = INPUTS / "trns_key_40x30.png"
    # The scene's rectangle is (250, 250, 250): the key colour.
    scene(40, 30, 6).save(keyed, transparency=(250, 250, 250), optimize=False)
    return [rotated, keyed]


def main() -> None:
    inputs = write_inputs()
    for name, config in CONFIGS.items():
        if name == "internvl_keep_key":
            images = inputs[1:]
        else:
            images = sorted(IMAGES.iterdir()) + (inputs if name == "internvl" else [])
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
        proc = processor(config)
        for path in images:
            got = proc(load_image(str(path)), return_tensors="np")
            tensors = {"pixel_values": np.ascontiguousarray(got["pixel_values"], dtype=np.float32)}
            for key in ("image_grid_thw", "num_patches"):
                if key in got:
                    tensors[key] = np.asarray(got[key], dtype=np.int64).reshape(-1)
            save_file(tensors, str(out / f"{path.stem}.safetensors"))
            extra = {k: v.tolist() for k, v in tensors.items() if k != "pixel_values"}
            print(f"{name}/{path.stem}: pixel_values {list(tensors['pixel_values'].shape)} {extra}")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
