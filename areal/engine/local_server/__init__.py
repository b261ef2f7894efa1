"""Generation core of the built-in inference server (``core.GenerationCore``) and its
weight loaders (``weights``). The HTTP app lives in ``areal.infra.launcher.local_server``."""
