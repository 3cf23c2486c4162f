"""Adapters that run models written for other frameworks on ds_ring's sequence-parallel attention.

Each adapter imports its framework lazily and uses ds_ring's public API only; nothing in the core
imports them (docs/design.md §Import rules). ``ds_ring.integrations.hf``: Hugging Face transformers models.
"""
