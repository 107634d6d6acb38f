"""Per-model adapters: the CP plans cp_ops writes for models whose diffusers class has no ``_cp_plan`` (one file
each). Models whose class has a plan need no adapter: their entry in :mod:`..registry` names the text inputs."""
