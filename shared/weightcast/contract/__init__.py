"""The wire contract: Redis keys, the batch codec, the fused layout, manifests, snapshots.

Everything two processes must agree on lives here, once. It imports nothing else of
weightcast, and no trainer, publisher or demo dependency, so every role can use it.
"""
