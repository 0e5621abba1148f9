"""The in-place weight reload, run inside vLLM's worker processes (``worker_extension_cls``).

vLLM's own ``reload_weights`` loads a checkpoint into the live parameters and re-runs the
post-load processing of every layer the checkpoint fed. On the CPU that processing packs each
GEMM's weight into a kernel-specific copy (oneDNN, or sgl's packed format), and the layer then
computes from that copy, not from its parameter. A layer the checkpoint does not name is never
processed again: a tied LM head (``tie_word_embeddings``, as in SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B)
shares the embedding's parameter, which the reload updates, but keeps the packed copy of the
*old* embedding, so the engine would sample from the new body and the old head. After the
reload every CPU GEMM that keeps its weight beside its packed copy (embeddings and LM heads:
linear layers drop theirs) is packed again from the weight it now holds. On CUDA the head reads
the shared parameter itself and nothing is repacked.

Only this module's method names cross the process boundary (``collective_rpc("reload_policy")``):
no callable or tensor is pickled.
"""
from __future__ import annotations

from typing import Any

EXTENSION = f"{__name__}.PolicyReload"


def repack_cpu_gemms(model: Any) -> int:
    """Pack again, from their current weights, the CPU GEMMs that keep their weight; returns how many.

    A no-op (0) off the CPU platform.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


class PolicyReload:
    """Mixed into vLLM's worker class by vLLM itself; ``self`` is the worker."""

    def reload_policy(self, weights_path: str) -> int:
        """Load the weights under ``weights_path`` in place, then repack what the reload left stale.

        Returns how many layers were repacked (0 on CUDA).
        """
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return repack_cpu_gemms(self.model_runner.get_model())  # type: ignore[attr-defined]
