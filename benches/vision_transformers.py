"""transformers' side of benches/vision_vs_transformers.sh: a Qwen2.5-VL vision tower in eager f32.

    python benches/vision_transformers.py prep VLM_DIR WORK   # a 1024x1024 image -> WORK/pixels.safetensors
    python benches/vision_transformers.py run VLM_DIR WORK    # one timed forward of the tower, JSON on stdout

`prep` draws a deterministic 1024x1024 RGB image (gradients, edges, noise) and runs transformers'
Qwen2VLImageProcessorPil with Qwen2.5-VL-7B-Instruct's min/max pixels (1024x1024 -> 1036x1036,
74x74 = 5476 patches): the same pixel_values feed both tools. `run` loads the checkpoint with
Qwen2_5_VLForConditionalGeneration (f32, eager attention), times `model.model.visual` on those
pixels and writes its output to WORK/transformers_embeds.safetensors for the parity check.
"""

import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch


def prep(work: Path) -> None:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:1024, 0:1024]
    img = np.stack([(x * 255 // 1023), (y * 255 // 1023), ((x ^ y) & 255)], -1).astype(np.int32)
    img[256:768, 300:700] = 240
    img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(img, "RGB")
    image.save(work / "image_1024.png")
    # Qwen2.5-VL-7B-Instruct's preprocessor_config.json: min_pixels 3136, max_pixels 12845056.
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 12845056})
    out = processor(images=[image], return_tensors="pt")
    from safetensors.torch import save_file

    save_file(
        {"pixel_values": out["pixel_values"].float().contiguous(), "image_grid_thw": out["image_grid_thw"]},
        str(work / "pixels.safetensors"),
    )
    print(json.dumps({"pixel_values": list(out["pixel_values"].shape), "grid": out["image_grid_thw"].tolist()}))


def run(vlm: Path, work: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(vlm), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    load_s = time.perf_counter() - t0
    pixels = load_file(str(work / "pixels.safetensors"))
    t0 = time.perf_counter()
    out = model.model.visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"])
    forward_s = time.perf_counter() - t0
    embeds = out.pooler_output if hasattr(out, "pooler_output") else out
    save_file({"image_embeds": embeds.contiguous()}, str(work / "transformers_embeds.safetensors"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"load_s": load_s, "forward_s": forward_s, "max_rss_bytes": rss,
                      "threads": torch.get_num_threads(), "embeds": list(embeds.shape)}))


if __name__ == "__main__":
    mode, vlm, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    prep(work) if mode == "prep" else run(vlm, work)
