"""AReaL's import path of the SGLang client engine, kept as a re-export for users' scripts;
the client lives in ``areal.inference.clients.sglang``."""

from areal.inference.clients.sglang import RemoteSGLangEngine, SGLangBackend

__all__ = ["RemoteSGLangEngine", "SGLangBackend"]
