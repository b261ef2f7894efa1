"""The FSDP2 training engine, one room per job (``engine``: training; ``checkpoint``: HF and
DCP; ``weight_export``: what is exported to the inference servers; ``weight_push``: the
disk/xccl push parts; ``fingerprints``: digests for verified weight syncs; ``attention``,
``parallelize``, ``logprob_head``: helpers). ``FSDPEngine`` is also importable from
``areal.engine.fsdp_engine`` (AReaL's path)."""

from areal.engine.fsdp.engine import FSDPEngine

__all__ = ["FSDPEngine"]
