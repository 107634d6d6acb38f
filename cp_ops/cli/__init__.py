"""The user tools, a layer above the cp_ops core: ``cp-ops bench | run MODEL | bound MODEL | generate | env`` and what
they share.

:mod:`.main` (argument parsing, checks, the ``cp-ops`` entry point), :mod:`.bench`, :mod:`.run` (with :mod:`.models`,
:mod:`.profile`), :mod:`.bound` (the zero-communication bound: :mod:`.bound_args`, :mod:`.bound_sides`,
:mod:`.bound_procs`, :mod:`.bound_report`, and :mod:`.bound_fill`, the fake groups it registers from here),
:mod:`.generate`, :mod:`.env_report`, :mod:`.launch` (start or join ranks). The core (``cp_ops.*`` outside this
folder) never imports from here. Importing this package imports nothing else (the CLI parses its arguments before it
imports torch).
"""
