"""The built-in inference server: generation core (``core``), weight loaders (``weights``),
HTTP app (``app`` + ``openai_api``), command line (``python -m areal.inference.server``)
and local process launching (``launch``)."""
