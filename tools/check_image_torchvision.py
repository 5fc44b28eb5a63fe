"""Measures how far transformers' torchvision image processors (`Qwen2VLImageProcessor`,
`GotOcr2ImageProcessor`, the default backend when torchvision is installed) land from the PIL
backends (`Qwen2VLImageProcessorPil`, `GotOcr2ImageProcessorPil`) that `src/image/` reproduces, on
the processor configs and images of tests/fixtures/image/. Prints max and mean |Δ| of
`pixel_values` per (config, image), for docs/reference/images.md; writes nothing.

Needs torchvision, which has no wheel for the main venv's torch 2.15, hence its own venv
(tools/README.md, "tools/.venv-tv"):

    tools/.venv-tv/bin/python tools/check_image_torchvision.py
"""

import json
from pathlib import Path

import numpy as np
from transformers.image_utils import load_image
from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "tests" / "fixtures" / "images"
GOLDENS = ROOT / "tests" / "fixtures" / "image"


def main() -> None:
    for name in ("qwen2_vl", "qwen3_vl", "internvl"):
        config = json.loads((GOLDENS / name / "preprocessor_config.json").read_text())
        kwargs = {k: v for k, v in config.items() if k != "image_processor_type"}
        if name == "internvl":
            pil, tv = GotOcr2ImageProcessorPil(**kwargs), GotOcr2ImageProcessor(**kwargs)
        else:
            pil, tv = Qwen2VLImageProcessorPil(**kwargs), Qwen2VLImageProcessor(**kwargs)
        assert tv.backend == "torchvision", tv.backend
        worst_max, worst_mean = 0.0, 0.0
        for path in sorted(IMAGES.iterdir()):
            image = load_image(str(path))
            a = np.asarray(pil(image, return_tensors="np")["pixel_values"], dtype=np.float64)
            b = tv(image, return_tensors="pt")["pixel_values"].double().numpy()
            d = np.abs(a - b)
            worst_max, worst_mean = max(worst_max, d.max()), max(worst_mean, d.mean())
            print(f"{name}/{path.stem}: max |Δ| {d.max():.4f}, mean |Δ| {d.mean():.5f}")
        print(f"{name}: worst max |Δ| {worst_max:.4f}, worst mean |Δ| {worst_mean:.5f}")


if __name__ == "__main__":
    main()
