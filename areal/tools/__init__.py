"""Command-line tools shipped with areal (installation check, trace conversion)."""
