"""The trainer worker: torchtitan 0.2.0 training a Qwen3 policy on rollout batches from Redis.

Start it through :func:`weightcast_trainer.main.run_trainer` (``weightcast trainer``), which
selects the device type before torchtitan is imported.
"""
