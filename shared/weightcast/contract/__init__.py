"""The wire contract: Redis keys, the batch codec, the fused layout, manifests, snapshots.

Everything two processes must agree on lives here, once. It imports nothing else of
weightcast, and no trainer, publisher or demo dependency, so every role can use it. It writes
no file: its formats are written durably by :mod:`weightcast.runtime.durable` (it reads the
files whose format it parses, at the edge).
"""
