"""Trimming: the trim addon, its policy (pure) and token counting."""
