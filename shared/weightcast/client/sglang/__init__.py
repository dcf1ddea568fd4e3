"""SGLang nodes: a running SGLang engine kept on the newest weightcast version.

The node leases each version, reads it and verifies every block (weightcast's client, in the
node's process, by delta from the version it holds where it can), checks that it fits the
engine, and only then hands the tensors to SGLang's own update API
(``begin_weight_update``, ``update_weights_from_tensor``, ``end_weight_update``) and sets the
version SGLang reports (``weight_version``). A version refused is refused before SGLang sees a
byte of it: no parameter is touched.

* :mod:`.staging`: lease, verify and read a version for an engine (no SGLang).
* :mod:`.engine`: the update sequence, :func:`~.engine.swap`, for any SGLang engine, and the
  node, :class:`~.engine.SglangNode`.
* :mod:`.local_engine`: an ``sglang.Engine`` in this process.
* :mod:`.server`: an SGLang server's update routes over HTTP (the node on the server's host).
* :mod:`.server_node`: the loop behind ``weightcast follow --sglang-url``.

Only :mod:`.local_engine` and :mod:`.server` import SGLang, lazily, at the first update; the
rest runs in the core install.
"""
