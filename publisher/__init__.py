"""The publisher daemon: complete snapshots in, registered vllm-fused versions out."""
