"""vLLM worker extension used by areal's vLLM servers (``--worker-extension-cls``).

Loaded by vLLM inside its worker processes, possibly under a separate interpreter: it
imports only torch and vLLM, never ``areal``.

``areal_reload_weights(weights_path)`` (called through ``POST /collective_rpc``) reloads
the weights in place with vLLM's own ``reload_weights`` and then refreshes every layer
that keeps a pre-packed copy of a weight it still holds. On CPU, vLLM builds a packed
GEMM kernel for embedding-shaped layers (the output layer, ``ParallelLMHead`` /
``VocabParallelEmbedding``) from their weight at load time. With tied embeddings the
output layer is not in the checkpoint, so vLLM's reload leaves its packed copy stale and
the server samples from the old output layer while its embeddings are new. Re-running
the dispatch for such layers rebuilds the packed copy from the reloaded weight.
"""

from __future__ import annotations


class ArealWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``)."""

    def areal_reload_weights(self, weights_path: str) -> dict:
        self.reload_weights(weights_path=weights_path)
        return {"repacked": self.areal_refresh_packed_weights()}

    def areal_refresh_packed_weights(self) -> list[str]:
        """Rebuild CPU GEMM dispatch for layers that keep their (now reloaded) weight."""
        import torch

        if torch.device(getattr(self, "device", "cpu")).type != "cpu":
            return []
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model = self.model_runner.get_model()
        done: list[str] = []
        seen: set[int] = set()
        for name, module in model.named_modules(remove_duplicate=False):
            weight = getattr(module, "weight", None)
            if (
                id(module) in seen
                or not hasattr(module, "cpu_linear")
                or not isinstance(weight, torch.Tensor)
                or weight.ndim != 2
                or weight.numel() == 0  # weight moved into the packed kernel: reloaded with it
            ):
                continue
            seen.add(id(module))
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            done.append(name)
        return done
