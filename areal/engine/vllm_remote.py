"""AReaL's import path of the vLLM client engine, kept as a re-export for users' scripts;
the client lives in ``areal.inference.clients.vllm``."""

from areal.inference.clients.vllm import RemotevLLMEngine, VLLMBackend

__all__ = ["RemotevLLMEngine", "VLLMBackend"]
