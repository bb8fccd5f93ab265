"""Do a trainer's image processor and the engine's agree (issue 42)? vLLM preprocesses images with transformers'
torchvision backend; a trainer without torchvision (this project's venv, the audit) gets the PIL one. Both come from
the same ``preprocessor_config.json`` (the tiny Qwen2-VL's). For photo-like images (smooth gradients plus noise) at
sizes that need resampling, this prints each backend's grid (which fixes the placeholder count, so the token IDs)
and how far their ``pixel_values`` lie apart. Runs itself in the vLLM venv with the pinned torchvision beside it.

    .venv/bin/python benchmarks/bench_image_processors.py [--out bench_image_processors.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SIZES = [(1024, 768), (640, 480), (333, 517), (224, 224), (100, 60), (56, 56)]


def _image(width: int, height: int, seed: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    x = np.linspace(0.0, 1.0, width)[None, :, None] * np.ones((height, 1, 1))
    y = np.linspace(0.0, 1.0, height)[:, None, None] * np.ones((1, width, 1))
    noisy = np.concatenate([x, y, (x + y) / 2], axis=2) + rng.normal(0.0, 0.1, (height, width, 3))
    return Image.fromarray((255 * np.clip(noisy, 0.0, 1.0)).astype(np.uint8))


def measure() -> list[dict[str, Any]]:
    """In the vLLM venv: both backends on every size."""
    from transformers import AutoImageProcessor

    from polar_gym.tiny_vlm import PROCESSOR_CONFIG

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG))
        pil = AutoImageProcessor.from_pretrained(folder, backend="pil")
        torchvision = AutoImageProcessor.from_pretrained(folder, backend="torchvision")
    rows = []
    for seed, (width, height) in enumerate(SIZES):
        image = _image(width, height, seed)
        a, b = pil(images=[image], return_tensors="pt"), torchvision(images=[image], return_tensors="pt")
        diff = (a["pixel_values"] - b["pixel_values"]).abs()
        rows.append({"size": f"{width}x{height}", "grid_pil": a["image_grid_thw"].tolist()[0],
                     "grid_torchvision": b["image_grid_thw"].tolist()[0],
                     "pixels_max_abs_diff": float(diff.max()), "pixels_mean_abs_diff": float(diff.mean()),
                     "backends": [type(pil).__name__, type(torchvision).__name__]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_image_processors.json"))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        print(json.dumps(measure()))
        return
    from polar_gym.assets import VLLM_VISION_DIR, torchvision_dir, vllm_python

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(VLLM_VISION_DIR), str(torchvision_dir()), str(root)])}
    out = subprocess.run([str(vllm_python()), str(Path(__file__).resolve()), "--inside"], env=env, check=True,
                         capture_output=True, text=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    print(f"{'size':>10} {'grid (PIL)':>12} {'grid (torchvision)':>19} {'max |Δpixel|':>13} {'mean |Δpixel|':>14}")
    for row in rows:
        print(f"{row['size']:>10} {row['grid_pil']!s:>12} {row['grid_torchvision']!s:>19} "
              f"{row['pixels_max_abs_diff']:>13.4f} {row['pixels_mean_abs_diff']:>14.6f}")
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
