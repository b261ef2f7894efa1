"""Command-line tools (``python -m areal.tools.<name>``): the memory planner, the installation check."""
