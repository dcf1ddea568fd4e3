"""The publisher daemon: complete snapshots in, verified versions in Redis and on disk out."""
