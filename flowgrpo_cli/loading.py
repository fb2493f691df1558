"""Quiet loading of diffusers and transformers models, for every package that loads one.

It sits below every sub-package (with errors.py and untrusted.py) because both the model
adapters (`models`) and the CLIP rewards (`rewards`) load through it, and neither may import
the other for it: `models.tiny` builds the aesthetic reward's head, so `rewards` importing
`models` would make the two packages import each other.
"""

from __future__ import annotations


def quiet_loading() -> None:
    """Loading (and saving) prints per-component progress bars and warnings (a torchvision
    fallback, CLIP prompts cut at 77 tokens, as the pipelines do) that drown our own progress:
    errors only."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()
