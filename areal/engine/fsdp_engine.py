"""Moved: the FSDP2 training engine lives in the folder ``areal.engine.fsdp`` (``engine``:
training; ``checkpoint``: HF/DCP; ``weight_export``: exported tensors and buckets;
``weight_push``: disk/xccl push parts; ``fingerprints``: digests for verified syncs;
``attention`` / ``parallelize`` / ``logprob_head``: helpers). This path (AReaL's) re-exports
its public names."""

from areal.engine.fsdp.checkpoint import write_safetensors
from areal.engine.fsdp.engine import FSDPEngine
from areal.engine.fsdp.weight_export import bucket_param_specs

__all__ = ["FSDPEngine", "bucket_param_specs", "write_safetensors"]
