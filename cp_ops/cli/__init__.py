"""The user tools above the cp_ops core: ``cp-ops bench | run MODEL | bound MODEL | generate | env`` (entry point:
:mod:`.main`; each command's arguments in a torch-free ``<command>_args``). The core never imports from here, and
importing this package imports nothing else (the CLI parses its arguments before it imports torch).
"""
