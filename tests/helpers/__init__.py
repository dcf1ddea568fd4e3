"""What the tests share, by theme: files, models, snapshots, processes, redis_state, s3,
versions."""
