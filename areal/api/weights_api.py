"""What a training engine offers so that its weights can reach the inference servers.

``WeightSynchronizer`` (``areal.infra.weights.weight_sync``) owns the sync: it pauses
generation, has a transport (``areal.infra.weights.transports``) export and push the
weights, lets its hooks verify them and commits the version everywhere (or rolls every
server back). The transports call only the methods below on the trainer side, so a second
training engine (or its controller) is synchronized by implementing them; none of them
pauses generation or sets a version on a server.

Which transport calls what:

=====================  ==========================================================
transport              trainer-side calls
=====================  ==========================================================
``disk``               ``save(SaveLoadMeta(path, "hf", with_optim=False))``: a complete
                       Hugging Face directory (safetensors shards + config)
``adapter`` (LoRA)     ``save_lora_adapter(path)``: the adapter only (peft layout)
``sharded``            ``export_weight_shards(path)``: every rank writes the tensors it
                       owns (full tensors, HF names, disjoint across ranks) as
                       ``*.safetensors`` files into ``path``; rank 0 also the config
``xccl``               ``update_weights(meta)``: training rank 0 broadcasts
                       ``get_param_specs(meta.weight_chunked_mem_mb)``'s buckets, in
                       order, over the group joined in ``connect_engine(engine, meta)``
                       (the engine announces each bucket to the servers)
``delta``              ``weight_delta_state()``: the kept base (version, dtype, deltas
                       since the last full sync, whether the next must be full);
                       a delta: ``export_weight_delta(path, base_version, version,
                       dtype)`` writes the changed elements against the kept base
                       (``path/delta/``, ``areal.infra.weights.delta``) + the
                       fingerprint reference; a full sync: ``save`` as ``disk``, then
                       ``export_weight_delta(None, None, version, dtype)`` stages the
                       cast copy; ``commit_weight_delta(version, committed)`` at commit
                       (the pending export becomes the base) or rollback (dropped)
=====================  ==========================================================

Also: ``set_version(v)`` / ``get_version()`` (called by the synchronizer at commit only),
and, for verified syncs, ``enable_weight_fingerprints`` / ``weights_fingerprint``
(``areal.infra.weights.weight_verify``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class WeightExporter(Protocol):
    """The trainer side of a weight sync (module docstring). Every method is collective
    over the training ranks when called on an engine; a controller calls all of them."""

    def save(self, meta: Any) -> None: ...

    def save_lora_adapter(self, path: str) -> int: ...

    def export_weight_shards(self, path: str) -> int: ...

    def get_param_specs(self, weight_chunked_mem_mb: int = 1024) -> list[list[Any]]: ...

    def connect_engine(self, engine: Any, meta: Any) -> None: ...

    def update_weights(self, meta: Any) -> None: ...

    def weight_delta_state(self) -> dict[str, Any]: ...

    def export_weight_delta(
        self, path: str | None, base_version: int | None, version: int, dtype: str
    ) -> dict[str, Any]: ...

    def commit_weight_delta(self, version: int, committed: bool = True) -> dict[str, Any]: ...

    def set_version(self, version: int) -> None: ...

    def get_version(self) -> int: ...
