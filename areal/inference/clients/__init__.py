"""Client engines, one per inference backend (``local``, ``vllm``, ``sglang``): each is a
``RemoteInfEngine`` (``areal.inference.remote``) with its protocol adapter and its server
command builder, registered in ``areal.inference.backends``."""
