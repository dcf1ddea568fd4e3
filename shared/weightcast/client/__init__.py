"""Clients for the people around the pipeline: rollout producers and inference nodes."""
