"""vLLM nodes: a ``weightcast`` weight-transfer backend inside vLLM, and drivers around it.

vLLM (0.32+) lets a weight-transfer backend load new weights into a running engine through
its weight-sync API (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``), from ``LLM`` or over ``vllm serve``'s HTTP
routes. weightcast's backend makes every vLLM worker (one per tensor-parallel rank) lease,
verify and read its own rank's part of a published version, and load it:

* :mod:`.plugin`: the ``vllm.general_plugins`` entry point that registers the backend under
  the name ``weightcast`` (vLLM runs it in every process it starts).
* :mod:`.backend`: the backend itself; imports vLLM, so it only loads inside vLLM workers.
* :mod:`.protocol`: what ``init_info`` and ``update_info`` carry (plain JSON).
* :mod:`.staging`: each rank's reader, kept for the engine's life: lease, verify and read
  the rank's part of a version (weightcast's client).
* :mod:`.placement`: where vLLM's own loaders expect that part (pure functions).
* :mod:`.inplace`: the ``inplace`` load: parts copied into live parameters through pinned
  staging (tensors only; tested on tensors shaped like vLLM's parameters).
* :mod:`.engine`: the update sequence (pause, start, update, finish, version, resume),
  :func:`~.engine.swap`, for any engine: ``vllm serve`` over HTTP (:mod:`.server`) or an
  ``LLM`` in this process (:mod:`.local_engine`).
* :mod:`.server_node`: the node loop behind ``weightcast follow --vllm-url``.

Only :mod:`.backend` and :mod:`.plugin` import vLLM (lazily for the plugin); the rest runs
in the core install, without vLLM.
"""
