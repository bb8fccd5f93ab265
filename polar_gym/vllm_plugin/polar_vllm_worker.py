"""Runs inside vLLM's own venv (a worker extension: ``--worker-extension-cls polar_vllm_worker.WeightReload``), never
in the project's: methods a weight update calls through vLLM's ``/collective_rpc``. Its folder (no package) is the
vLLM server's whole PYTHONPATH, so the server sees this module and nothing else of the project's venv.

Why: vLLM's in-place ``reload_weights`` re-processes only the layers whose weights it loaded. On the CPU build, a
layer packs its weight for oneDNN once when processed; a tied output layer (the tiny Qwen3's ``lm_head`` shares
``embed_tokens``) loads nothing from a checkpoint, so after a reload it kept multiplying by the old embedding
(measured here: |Δ logprob| up to 1.5 against transformers on the new weights). ``polar_refresh_tied_weights``
re-processes such layers from the values the reload wrote into their shared storage. On GPU builds the step finds
nothing packed and does the same harmless re-processing.

Imports only the standard library at import time (vLLM imports it in every worker process).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WeightReload"]


class WeightReload:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def polar_refresh_tied_weights(self) -> list[str]:
        """Re-process every module whose weight is shared with another module (tied embeddings), so packed copies
        of it hold the reloaded values; answers the modules refreshed."""
        runner: Any = getattr(self, "model_runner")  # noqa: B009  (the worker's, set by vLLM)
        model = runner.get_model()
        owners: dict[int, list[tuple[str, Any]]] = {}
        for name, module in model.named_modules():
            weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
            if weight is not None:
                owners.setdefault(id(weight), []).append((name, module))
        refreshed = []
        for modules in owners.values():
            if len(modules) < 2:
                continue
            for name, module in modules:
                method = getattr(module, "quant_method", None)
                process = getattr(method, "process_weights_after_loading", None)
                if process is not None:
                    process(module)
                    refreshed.append(name)
        return refreshed
