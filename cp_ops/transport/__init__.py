"""Transports move CP tensors between ranks. Each module exposes the same three launches:

``agkv_start(k, v, group) -> (k_full, v_full, work)``, ``ulysses_start(xs, group) -> (buf, work)`` and
``ulysses_inverse_start(x, group) -> (buf, work)``, with the layouts of :mod:`cp_ops.layout`; ``work.wait()``
makes the outputs valid for the current stream. :mod:`.select` picks one by name.
"""
