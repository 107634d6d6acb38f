"""Examples a user copies: ``generate`` (a whole diffusers pipeline under CP, run with torchrun) and the tiny
pipelines it builds when no checkpoint is given (``tiny``)."""
