"""Where versions live: one interface (:mod:`.base`), a directory and an S3 transport, and the
factory that picks one from a location (:mod:`.factory`)."""
