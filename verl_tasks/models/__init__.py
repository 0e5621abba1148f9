"""Policies: the built-in tiny model, HF models by name or path, saving and loading, generation."""
