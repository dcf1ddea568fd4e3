"""The train/inference mismatch of lagged batches, through the real trainer and publisher.

A producer here samples as an engine would: it loads a published version (``--layout hf``)
into transformers' own ``Qwen3ForCausalLM`` and reports the log-probabilities of the tokens.
Such a batch, trained steps after its version, must score about 0 against the weights of the
step that sampled it (the trainer keeps them); one whose log-probabilities come from other
weights than the version it names must score far above; one whose step's weights were
dropped (``trainer.mismatch_memory_mb`` holds three) is not scored at all.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import redis
import torch

from weightcast.client.producer import BatchProducer
from weightcast.contract.keys import Keys

from helpers.models import HF_SHAPES, checkpoint_tensors, save_pretrained_qwen3
from helpers.processes import start_weightcast, stop, torchrun, wait_for
from helpers.redis_state import heartbeat, push_batches

SHAPE = "untied-odd"
SEQ = 24


def step_lines(log: str) -> dict[int, dict[str, str]]:
    """Each ``step`` log line's fields, by step."""
    lines = {}
    for line in log.splitlines():
        if re.search(r"\bstep step=\d+ ", line):
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            lines[int(fields["step"])] = fields
    return lines


class VersionSampler:
    """An engine's view of a published version: transformers' own model loaded from the
    version's directory (``--layout hf``), computing in fp32."""

    def __init__(self, weights: Path, shape: str) -> None:
        self.weights = weights
        self.vocab = HF_SHAPES[shape].shape.vocab_size

    @torch.no_grad()
    def batch(self, version: int, seed: int) -> dict[str, torch.Tensor]:
        """A batch of random tokens, its second half trained, with the log-probabilities
        version ``version`` gives them."""
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(
            self.weights / f"v{version}", dtype=torch.float32, output_loading_info=True
        )
        assert not any(info.values()), info  # nothing missing, unexpected or mismatched
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, self.vocab, (2, SEQ), generator=gen)
        logp = torch.log_softmax(model(input_ids).logits.float(), dim=-1)
        picked = logp[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        loss_mask = torch.zeros(2, SEQ, dtype=torch.bool)
        loss_mask[:, SEQ // 2 :] = True
        old = torch.zeros(2, SEQ)
        old[:, 1:] = torch.where(loss_mask[:, 1:], picked, 0.0)
        return {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "advantages": torch.randn(2, generator=gen),
            "old_logprobs": old,
        }


def version_of(client: redis.Redis, keys: Keys, step: int) -> int | None:
    """The published version of ``step``, None until there is one."""
    latest = int(client.get(keys.latest) or 0)
    for version in range(latest, 0, -1):
        if client.hget(keys.version(version), "step") == str(step).encode():
            return version
    return None


def train_a_published_step(
    url: str, client: redis.Redis, keys: Keys, log: Path, per_step: int, vocab: int
) -> int:
    """Train one step on ``per_step`` batches without log-probabilities once no snapshot
    write is running, and wait for its version: the version whose weights the trainer then
    holds. (A step trained while the previous write still runs publishes nothing.)"""
    holds = max(step_lines(log.read_text()), default=0)
    skipped = f"snapshot skipped: the previous write is still running step={holds}"
    wait_for(lambda: version_of(client, keys, holds) or skipped in log.read_text(), 300, "a write")
    if skipped in log.read_text():
        time.sleep(2)  # the write that made it skip ends
    push_batches(url, keys, per_step, policy_version=1, prefix=f"plain-{holds}-", vocab_size=vocab)
    return wait_for(lambda: version_of(client, keys, holds + 1), 300, f"step {holds + 1}")


def version_mb(start: Path) -> float:
    """One kept version: every parameter in bf16 (the checkpoint is untied; an MoE's experts
    are stacked in the trainer, the same bytes)."""
    return sum(t.numel() * 2 for t in checkpoint_tensors(start).values()) / 2**20


@pytest.mark.parametrize("shape", ["untied-odd", "moe-untied-odd"])
def test_lagged_batches_score_against_the_weights_that_sampled_them(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path, shape: str
) -> None:
    """Dense and Qwen3-MoE. Steps 1-2 train batches without log-probabilities (v2, v3 are
    their weights). Then a batch sampled from v2 (step 1) trains in step 3 (lag 1): ~0; a
    batch tagged v2 but sampled from v3 trains in step 4 (lag 2): far above, as the distance
    of one step at lr 1e-2; a batch sampled from v1 (step 0) trains in step 5, when three
    newer steps are kept and step 0 is not: not scored."""
    start = save_pretrained_qwen3(tmp_path / "start", shape, torch.bfloat16)
    budget = 3.5 * version_mb(start)
    logs = tmp_path / "logs"
    logs.mkdir()
    publisher = start_weightcast(
        cli_env, logs / "publisher.log", "publisher", "--layout", "hf", "--rescan-seconds", "0.2",
        "--keep", "100",
    )  # fmt: skip
    trainer = start_weightcast(
        cli_env, logs / "trainer.log", "trainer", "--init-from", str(start), "--steps", "5",
        "--lr", "1e-2", "--mismatch-memory-mb", f"{budget:.6f}",
    )  # fmt: skip
    url = cli_env["WEIGHTCAST_REDIS_URL"]
    vocab = HF_SHAPES[shape].shape.vocab_size
    try:
        wait_for(lambda: client.get(keys.latest) == b"1", 300, "the start published as v1")
        for _ in range(2):
            train_a_published_step(url, client, keys, logs / "trainer.log", 1, vocab)
        assert [int(client.hget(keys.version(v), "step")) for v in (1, 2, 3)] == [0, 1, 2]
        sampler = VersionSampler(tmp_path / "weights", shape)
        producer = BatchProducer(url, keys.namespace, name="engine", max_pending=0)
        producer.push(sampler.batch(2, seed=1), 2, uid="exact")
        producer.push(sampler.batch(3, seed=2), 2, uid="wrong")
        producer.push(sampler.batch(1, seed=3), 1, uid="dropped")
        assert trainer.wait(timeout=300) == 0
        beat = heartbeat(client, keys)
    finally:
        stop(trainer)
        stop(publisher)
    log = (logs / "trainer.log").read_text()
    assert "versions_kept=3" in log, log[-3000:]
    steps = step_lines(log)
    exact, wrong, dropped = steps[3], steps[4], steps[5]
    print(f"exact at lag 1: {exact}\nwrong at lag 2: {wrong}")
    assert (exact["mismatch_version"], exact["mismatch_lag"]) == ("2", "1")
    assert float(exact["mismatch_kl"]) < 1e-10 and float(exact["mismatch_max"]) < 1e-5
    assert (wrong["mismatch_version"], wrong["mismatch_lag"]) == ("2", "2")
    assert float(wrong["mismatch_kl"]) > 1e-3
    assert "mismatch_kl" not in dropped and dropped["policy_versions"] == "1"
    assert float(beat["mismatch_kl"]) == pytest.approx(float(wrong["mismatch_kl"]), rel=1e-3)
    assert beat["mismatch_version"] == "2"


def test_two_fsdp_ranks_score_lagged_batches_against_the_weights_that_sampled_them(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Under FSDP every rank puts the same step's shards in and takes its own back: batches
    sampled from v1 and v2 (steps 0 and 1), trained at steps 3 and 4 (lags 1 to 3), score
    ~0 however the ranks share them; batches sampled from the step the trainer holds then
    (lag 0, scored on the training forward itself, with the fp32 weights) stay at the bf16
    rounding of those weights, so no swapped weight leaked into training."""
    import subprocess

    from helpers.files import REPO

    start = save_pretrained_qwen3(tmp_path / "start", SHAPE, torch.bfloat16)
    logs = tmp_path / "logs"
    logs.mkdir()
    publisher = start_weightcast(
        cli_env, logs / "publisher.log", "publisher", "--layout", "hf", "--rescan-seconds", "0.2",
        "--keep", "100",
    )  # fmt: skip
    with open(logs / "trainer.log", "wb") as out:
        trainer = subprocess.Popen(
            torchrun(2, "-m", "weightcast_trainer", "--init-from", str(start), "--lr", "1e-2"),
            env=cli_env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = cli_env["WEIGHTCAST_REDIS_URL"]
    vocab = HF_SHAPES[SHAPE].shape.vocab_size
    log = logs / "trainer.log"
    try:
        wait_for(lambda: client.get(keys.latest) == b"1", 300, "the start published as v1")
        for _ in range(2):
            train_a_published_step(url, client, keys, log, 2, vocab)
        sampler = VersionSampler(tmp_path / "weights", SHAPE)
        producer = BatchProducer(url, keys.namespace, name="engine", max_pending=0)
        versions = (1, 2, 1, 2)  # steps 0 and 1, while the trainer holds 2, then 3
        lagged = [sampler.batch(v, seed) for seed, v in enumerate(versions, start=1)]
        ids = [
            producer.push(b, v, uid=f"lagged-{i}")
            for i, (b, v) in enumerate(zip(lagged, versions, strict=True))
        ]
        wait_for(lambda: all(i in log.read_text() for i in ids), 300, "the lagged batches")
        version = train_a_published_step(url, client, keys, log, 2, vocab)
        for seed in (9, 10):  # one a rank: a step waits for every rank's micro-batches
            producer.push(sampler.batch(version, seed), version, uid=f"on-policy-{seed}")
        wait_for(lambda: "mismatch_lag=0" in log.read_text(), 120, "the on-policy batches")
    finally:
        stop(trainer, signal.SIGTERM)
        stop(publisher)
    steps = step_lines(log.read_text())
    lagged = [f for f in steps.values() if f.get("mismatch_lag", "0") != "0"]
    print("lagged:", [(f["mismatch_lag"], f["mismatch_kl"]) for f in lagged])
    assert len(lagged) >= 2, log.read_text()[-3000:]
    assert all(float(f["mismatch_kl"]) < 1e-10 for f in lagged), lagged
    assert all(float(f["mismatch_max"]) < 1e-5 for f in lagged), lagged
    (last,) = [f for f in steps.values() if f.get("mismatch_lag") == "0"]
    print("on-policy:", last["mismatch_kl"])
    assert last["mismatch_lag"] == "0" and float(last["mismatch_kl"]) < 1e-5
