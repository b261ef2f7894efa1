"""Everything on the serving side of the HTTP wire: what serves tokens and what calls it.

- ``server/``: the built-in inference server (generation core, weight loading, the HTTP
  app with its OpenAI-compatible routes, ``python -m areal.inference.server``);
- ``backends``: the one registry, backend name (``local`` / ``vllm`` / ``sglang``) ->
  client engine, protocol adapter, server command;
- ``clients/``: one client engine per backend (``RemoteLocalEngine``, ``RemotevLLMEngine``,
  ``RemoteSGLangEngine``), each a ``RemoteInfEngine`` owning its protocol adapter;
- ``remote/``: ``RemoteInfEngine``, the protocol-agnostic client (HTTP plumbing, the
  rotation of healthy servers, server launch, weight-update RPCs);
- ``teacher``: a distillation teacher served by an inference engine;
- ``vllm_ext/``: the worker extension vLLM loads for weight updates.

Training engines live in ``areal.engine``; nothing there serves or calls a server.
"""
