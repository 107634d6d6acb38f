"""The user tools, a layer above the cp_ops core: ``cp-ops bench | run MODEL | generate | env`` and what they share.

:mod:`.main` (argument parsing, checks, the ``cp-ops`` entry point), :mod:`.bench`, :mod:`.run` (with :mod:`.models`, :mod:`.profile`), :mod:`.generate`,
:mod:`.env_report`, :mod:`.launch` (start or join ranks); timing lives in the core (:mod:`cp_ops.timing`). The core (``cp_ops.*`` outside this
folder) never imports from here. Importing this package imports nothing else (the CLI parses its arguments
before it imports torch).
"""
