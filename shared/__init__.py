"""weightcast's contract: configuration, Redis keys, batch codec, layout math and manifest.

Both daemons and every client import this package rather than restating key names or
tensor rules; it never imports torchtitan, so publishers and inference nodes stay light.
"""
