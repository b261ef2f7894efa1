"""Command-line tools (``python -m areal.tools.<name>``)."""
