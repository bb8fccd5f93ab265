"""Runs at start-up in a vLLM server that serves a vision model (``polar_gym.assets.vllm_server_env(vision=True)``
puts this folder and the pinned torchvision on its PYTHONPATH), never in the project's venv.

Why: every vLLM vision model imports torchvision (Qwen2-VL through transformers' image processing). PyPI has only
torchvision's CUDA build, whose compiled ops library does not load against the CPU torch of vLLM's CPU build, and
torchvision's import then fails at its first ``register_fake("torchvision::nms")``, which needs the op's schema from
that library. Declaring the two schemas first lets torchvision import; their kernels stay missing, so a call to
``nms`` would fail loudly, and vLLM's image path never calls them (tests/engine/test_vlm_vllm.py serves images).

Imports torch (which every vLLM process imports anyway), and only where torchvision is on the path.
"""

from __future__ import annotations

import importlib.util


def _declare_torchvision_ops() -> None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchvision") is None:
        return
    import torch

    # held in a global below: the schemas live as long as the library object does
    library = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[no-untyped-call]
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[no-untyped-call]
    globals()["_TORCHVISION_LIBRARY"] = library


_declare_torchvision_ops()
