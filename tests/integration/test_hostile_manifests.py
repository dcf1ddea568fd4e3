"""Against someone who can write Redis and the weights directory (and so recompute every
digest and ``manifest_sha256``), a node parses safely: every hostile manifest is a
WeightsError naming the file and the field, never another exception, and every byte a node
returns is one it read from the file and verified.

Versions are copies of a real published version (tp=2: rank slices and rank-cut blocks),
their manifest changed and registered in the real Redis with its new SHA-256. Uninitialised
memory is poisoned (``torch.utils.deterministic.fill_uninitialized_memory``: NaN, or an
integer's maximum), and every returned tensor is compared byte for byte with the file's
bytes as safetensors reads them, so a byte never read or verified shows.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import resource
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from weightcast.client.node import Node
from weightcast.contract.errors import WeightsError
from weightcast.contract.manifest import MANIFEST_NAME, Manifest, file_entry, sha256_bytes

from helpers.models import drift, hf_state, rank_part
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment, copy_version, redigest, register_version, split_per_rank

TP = 2
EXAMPLES = 200
"""Random manifests per kind of version, drawn from a fixed seed."""


@pytest.fixture
def poisoned() -> Iterator[None]:
    """Fresh tensors filled with NaN (or an integer's maximum) instead of leftover memory."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before)


class Version:
    """One copy of version ``source`` whose manifest the test rewrites; each rewrite is
    registered anew."""

    def __init__(self, deployment: Deployment, source: int = 1) -> None:
        self.deployment = deployment
        self.number, self.directory = copy_version(deployment, source)
        register_version(deployment, self.number, like=source)
        self.valid: dict[str, Any] = json.loads((self.directory / MANIFEST_NAME).read_text())
        self.reader = deployment.reader()

    def write(self, manifest: object) -> bytes:
        text = json.dumps(manifest).encode()
        (self.directory / MANIFEST_NAME).write_bytes(text)
        self.deployment.client.hset(
            self.deployment.keys.version(self.number), "manifest_sha256", sha256_bytes(text)
        )
        return text

    def file(self, name: str) -> dict[str, Any]:
        return next(f for f in self.valid["files"] if f["name"] == name)


def read_everything(version: Version) -> list[WeightsError]:
    """Every read a node makes (follow's load and config, the backend's rank_tensors for
    each rank, verify): each either returns only bytes of the file, or is a WeightsError."""
    reader, number = version.reader, version.number
    refusals = []
    reads: list[tuple[Callable[[], dict[str, torch.Tensor]], int | None]] = [
        (lambda: reader.load(number), None),
        *((lambda rank=rank: reader.rank_tensors(number, rank, TP), rank) for rank in range(TP)),
    ]
    for read, rank in reads:
        try:
            tensors = read()
        except WeightsError as exc:
            refusals.append(exc)
            continue
        assert_bytes_of_the_file(version, tensors, rank)
    for check in (reader.config, reader.verify):
        try:
            check(number)
        except WeightsError as exc:
            refusals.append(exc)
    return refusals


def assert_bytes_of_the_file(
    version: Version, tensors: dict[str, torch.Tensor], rank: int | None
) -> None:
    """``tensors`` are, byte for byte, what the version's files hold for them (a whole
    tensor, or tp rank ``rank``'s part of it: its slice, or its entry in a per-rank file)."""
    manifest = Manifest.read(version.directory)
    files = {
        name: load_file(str(version.directory / name))
        for name in {t.file for t in manifest.tensors}
    }
    per_rank = manifest.per_rank_files
    entries = {t.name: t for t in manifest.tensors if t.rank == (rank if per_rank else None)}
    assert tensors.keys() == entries.keys()
    for name, got in tensors.items():
        entry = entries[name]
        full = files[entry.file][name]
        whole = rank is None or per_rank
        want = full if whole else rank_part(full, entry.shard, rank, TP)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{name}: bytes not read from the file"


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def set_in(path: tuple[str | int, ...], value: object) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        target: Any = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def tensor_index(manifest: dict, name: str) -> int:
    return next(i for i, t in enumerate(manifest["tensors"]) if t["name"] == name)


def float_lengths(manifest: dict) -> None:
    """The weights file's block lengths as floats, shifted by a half so that they still
    sum to the file's size."""
    entry = next(f for f in manifest["files"] if f["name"] == "model.vllm-fused")
    blocks = entry["blocks"]
    lengths = blocks["lengths"] or [
        min(blocks["block_bytes"], entry["bytes"] - at)
        for at in range(0, entry["bytes"], blocks["block_bytes"])
    ]
    assert len(lengths) > 1, "the tp=2 file is cut at the ranks' rows"
    blocks["lengths"] = [lengths[0] - 0.5, *lengths[1:-1], lengths[-1] + 0.5]


def fused_norm(rank_rows: int) -> Callable[[dict], None]:
    """``model.norm.weight`` (16 rows) described as a qkv tensor of ``rank_rows`` a rank."""

    def change(manifest: dict) -> None:
        index = tensor_index(manifest, "model.norm.weight")
        manifest["tensors"][index]["shard"] = {
            "kind": "qkv",
            "dim": 0,
            "tp": TP,
            "rank_rows": rank_rows,
            "q_rows": rank_rows - 2,
            "kv_rows": 1,
        }

    return change


def fused_experts_norm(manifest: dict) -> None:
    """``model.norm.weight`` described as vLLM's FusedMoE experts, 2**40 experts a rank."""
    index = tensor_index(manifest, "model.norm.weight")
    manifest["tensors"][index]["shard"] = {
        "kind": "experts",
        "dim": 0,
        "tp": TP,
        "rank_rows": 2**40,
        "ep": TP,
        "experts": 2**40,
    }


WEIGHTS = 0  # files[0] is model.vllm-fused (config.json is written, and listed, last)

HOSTILE_FIELDS = {
    "digest algorithm as a list": (
        set_in(("files", WEIGHTS, "blocks", "algorithm"), ["xxh3-128"]),
        r"files\[0\]\.blocks\.algorithm is \['xxh3-128'\], not a string",
    ),
    "float block_bytes": (
        set_in(("files", WEIGHTS, "blocks", "block_bytes"), 65536.5),
        r"files\[0\]\.blocks\.block_bytes is 65536\.5, not an integer >= 1",
    ),
    "float block lengths that sum to the size": (
        float_lengths,
        r"files\[0\]\.blocks\.lengths is \[.*\], not a list of integers >= 1",
    ),
    "float file bytes": (
        lambda m: m["files"][WEIGHTS].update(bytes=float(m["files"][WEIGHTS]["bytes"])),
        r"files\[0\]\.bytes is \d+\.0, not an integer >= 0",
    ),
    "tensor name as a list": (
        lambda m: m["tensors"][0].update(name=[m["tensors"][0]["name"]]),
        r"tensors\[0\]\.name is \['.*'\], not a string",
    ),
    "a norm sharded as qkv of 4096 rows a rank": (
        fused_norm(4096),
        r"tensors\[\d+\] \(model\.norm\.weight\)\.shard does not fit its shape \[16\]",
    ),
    "rank_rows of 2**40": (
        fused_norm(2**40),
        r"tensors\[\d+\] \(model\.norm\.weight\)\.shard does not fit its shape \[16\]",
    ),
    "rank_rows that are not the sum of their parts": (
        lambda m: m["tensors"][tensor_index(m, "model.layers.0.self_attn.qkv_proj.weight")][
            "shard"
        ].update(rank_rows=4096),
        r"qkv_proj\.weight\)\.shard rank_rows 4096 is not the sum of its parts",
    ),
    "a tensor of 2**40 rows": (
        lambda m: m["tensors"][tensor_index(m, "model.embed_tokens.weight")].update(
            shape=[2**40, 16]
        ),
        r"embed_tokens\.weight\): 35184372088832 bytes of bfloat16 \[1099511627776, 16\], "
        r"more than its file model\.vllm-fused holds",
    ),
    "a norm described as experts of 2**40 a rank": (
        lambda m: m.update(ep=TP) or fused_experts_norm(m),
        r"tensors\[\d+\] \(model\.norm\.weight\)\.shard does not fit its shape \[16\]: an "
        r"experts tensor has 3 dimensions",
    ),
    "an experts shard in a version that names no ep": (
        fused_experts_norm,
        r"\(model\.norm\.weight\)\.shard is laid out for ep=2, in a version that names no ep",
    ),
    "an ep that is neither 1 nor tp": (
        lambda m: m.update(ep=3),
        r"ep is 3: a tp=2 version's experts are laid out for ep 1 or 2",
    ),
    "a float ep": (lambda m: m.update(ep=2.0), r"ep is 2\.0, not an integer >= 1"),
    "an experts shard of another ep than the version's": (
        lambda m: m.update(ep=1) or fused_experts_norm(m),
        r"\.shard is laid out for ep=2, in a version for ep=1",
    ),
    "a shape of 100000 dimensions": (
        lambda m: m["tensors"][0].update(shape=[2**62] * 100_000),
        r"tensors\[0\] \(.*\)\.shape has 100000 dimensions, more than 64",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_FIELDS))
def test_a_hostile_field_is_a_weights_error_naming_the_file_and_field(
    deployment: Deployment, poisoned: None, case: str
) -> None:
    change, message = HOSTILE_FIELDS[case]
    version = Version(deployment)
    manifest = copy.deepcopy(version.valid)
    assert manifest["files"][WEIGHTS]["name"] == "model.vllm-fused"
    change(manifest)
    version.write(manifest)
    refusals = read_everything(version)
    assert len(refusals) == 2 + TP + 1, "load, rank_tensors of each rank, verify, config"
    for exc in refusals:
        assert str(exc).startswith(f"{version.directory}/{MANIFEST_NAME}: "), str(exc)
        assert re.search(message, str(exc)), str(exc)


def test_the_valid_version_reads_whole_and_by_rank_from_verified_bytes_only(
    deployment: Deployment, poisoned: None
) -> None:
    version = Version(deployment)
    assert read_everything(version) == []


# -- random mutations ----------------------------------------------------------------------


Path_ = tuple[str | int, ...]


def paths(value: object, at: Path_ = ()) -> Iterator[Path_]:
    """Every place in a JSON value (below the top)."""
    if at:
        yield at
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*at, index))


MISSING = object()


def replacements(value: object) -> st.SearchStrategy[object]:
    """What a hostile writer may put in place of ``value``: type swaps, floats, negative and
    huge numbers, lists, or nothing at all (the field removed)."""
    swaps: list[object] = [MISSING, None, True, False, "", "x", [], {}, [value], {"v": value}]
    if isinstance(value, bool):
        swaps += [not value, int(value)]
    elif isinstance(value, int):
        swaps += [value + 0.5, float(value), -1, -value, 0, value + 1, value - 1, 2**40, 2**63]
        swaps += [2**64 + value, str(value)]
    elif isinstance(value, str):
        swaps += [value + "x", value.upper(), "../" + value, 1, 0.5]
    elif isinstance(value, list) and value:
        swaps += [value[:-1], value + value[-1:], value[::-1], value * 2]
    elif isinstance(value, dict):
        swaps += [dict(list(value.items())[:-1])]
    return st.sampled_from(swaps)


@st.composite
def mutated(draw: st.DrawFn, valid: dict, under: Path_ = ()) -> dict:
    """``valid`` with one to three of its places (below ``under``) replaced or removed."""
    manifest = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        places = [p for p in paths(manifest) if p[: len(under)] == under and p != under]
        if not places:
            break
        path = draw(st.sampled_from(places))
        parent: Any = manifest
        for key in path[:-1]:
            parent = parent[key]
        value = draw(replacements(parent[path[-1]]))
        if value is MISSING:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(value)
    return manifest


def format_1(deployment: Deployment) -> int:
    """A copy of v1 with whole-file SHA-256 digests, as older publishers wrote it."""
    number, directory = copy_version(deployment, 1)
    redigest(directory, algorithm="sha256")
    register_version(deployment, number, like=1)
    return number


SOURCES: dict[str, Callable[[Deployment], int]] = {
    "blocks cut at the ranks' rows": lambda deployment: 1,
    "per-rank files": lambda deployment: split_per_rank(deployment, 1),
    "format 1 (whole-file sha256)": format_1,
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_random_mutations_never_crash_a_node_or_return_unverified_bytes(
    deployment: Deployment, poisoned: None, source: str
) -> None:
    version = Version(deployment, SOURCES[source](deployment))
    for exc in read_everything(version):  # the valid version: only load refuses per-rank files
        assert "is split into per-rank files" in str(exc), str(exc)
    outcomes = {"refused": 0, "read": 0}

    @seed(19)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(mutated(version.valid))
    def check(manifest: dict) -> None:
        version.write(manifest)
        refusals = read_everything(version)  # raises on any other exception or bad byte
        for exc in refusals:
            assert str(version.directory) in str(exc) or MANIFEST_NAME in str(exc), str(exc)
        outcomes["refused" if refusals else "read"] += 1

    check()
    assert outcomes["refused"] > EXAMPLES // 2, outcomes  # the mutations mostly do harm


@pytest.fixture
def capped_memory() -> Iterator[None]:
    """The process may map at most 8 GiB more than it has now (so a runaway allocation fails
    at once whatever the host's overcommit policy), until the test ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmSize:")
    )
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (8 << 30), hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_version_that_needs_more_memory_than_the_node_has_is_refused_and_the_next_loaded(
    deployment: Deployment, capped_memory: None
) -> None:
    """A sparse weights file of 16 TiB listed as one block: reading its header means reading
    that block. The node refuses the version (a WeightsError, not a MemoryError that would end
    ``follow``) and loads the next good one."""
    version = Version(deployment)
    weights = version.directory / "model.vllm-fused"
    size = 2**44 - 4096  # ext4's largest file
    os.truncate(weights, size)
    manifest = copy.deepcopy(version.valid)
    manifest["files"][WEIGHTS].update(
        bytes=size,
        blocks={
            "algorithm": "xxh3-128",
            "block_bytes": size,
            "digests": ["0" * 32],
            "lengths": None,
        },
    )
    manifest["delta"] = None
    version.write(manifest)
    node = Node(deployment.reader(), report_every=60)
    assert node.load(version.number) is None
    with pytest.raises(WeightsError, match="needs more memory than this node has"):
        version.reader.rank_tensors(version.number, 0, TP)
    good = Version(deployment)
    assert node.load(good.number) is not None and node.current == good.number


# -- random mutations of a delta -----------------------------------------------------------


@st.composite
def damaged(draw: st.DrawFn, frames: bytes) -> bytes:
    """The delta file's bytes with one to eight bytes changed, or cut short, or lengthened."""
    data = bytearray(frames)
    kind = draw(st.sampled_from(["bytes", "bytes", "cut", "longer"]))
    if kind == "cut":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "longer":
        return bytes(data) + draw(st.binary(min_size=1, max_size=64))
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.sampled_from([data[at] ^ 1, data[at] ^ 0x80, 0, 0xFF]))
    return bytes(data)


def listed_to_fit(manifest: dict, frames: bytes, path: Path) -> None:
    """As a writer who changes the delta's lengths would leave it: the delta file cut or
    padded to the bytes they add up to, and listed with that size and its block digests
    (so that more mutations pass the manifest's own checks and reach the node's read)."""
    try:
        delta = manifest["delta"]
        total = sum(sum(entry["lengths"]) for entry in delta["files"])
        listed = next(f for f in manifest["files"] if f["name"] == delta["file"])
    except (TypeError, KeyError, AttributeError, StopIteration):
        return
    if type(total) is not int or not 0 <= total <= 2 * len(frames):
        return
    path.write_bytes((frames + bytes(total))[:total])
    entry = file_entry(path)
    assert entry.blocks is not None
    listed.update(bytes=entry.bytes, blocks=dataclasses.asdict(entry.blocks), sha256=None)


@pytest.mark.parametrize("target", ["the delta file", "the manifest's delta"])
def test_random_damage_to_a_delta_leaves_a_node_whole_or_reads_verified_bytes(
    deployment: Deployment, poisoned: None, target: str
) -> None:
    """A node holding v1 (keep_base) reads a copy of v2 whose delta is damaged: it reads the
    version (by delta or in full) with every returned byte the file's, and the held tensors
    either v1 still or, by delta, the returned ones; only a damaged manifest may refuse it
    (a WeightsError), the held tensors bitwise v1."""
    deployment.step += 1
    state = hf_state(deployment.shape, torch.bfloat16)
    drift(state, deployment.step)  # what a training step does to v1's values
    write_snapshot(deployment.root / "checkpoints", deployment.step, deployment.shape, state)
    deployment.publisher.scan_once()
    version = Version(deployment, int(deployment.client.get(deployment.keys.latest)))
    assert version.valid["delta"]["base_version"] == 1, "the publisher wrote a delta from v1"
    delta_path = version.directory / version.valid["delta"]["file"]
    frames = delta_path.read_bytes()
    assert frames, "blocks changed"
    outcomes: dict[str, int] = {}
    strategy = damaged(frames) if target == "the delta file" else mutated(version.valid, ("delta",))

    @seed(29)
    @settings(
        max_examples=EXAMPLES // 2,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(strategy, st.integers(0, TP - 1))
    def check(change: Any, rank: int) -> None:
        node = deployment.reader()
        node.reader.keep_base = True
        held = node.rank_tensors(1, rank, TP)
        before = {name: raw_bytes(tensor).clone() for name, tensor in held.items()}
        if target == "the delta file":
            delta_path.write_bytes(change)
            version.write(version.valid)
        else:
            delta_path.write_bytes(frames)
            listed_to_fit(change, frames, delta_path)
            version.write(change)
        try:
            tensors = node.rank_tensors(version.number, rank, TP)
        except WeightsError as exc:
            assert target != "the delta file", f"a damaged delta file refused the version: {exc}"
            assert str(version.directory) in str(exc) or MANIFEST_NAME in str(exc), str(exc)
            outcome = "refused"
        else:
            assert_bytes_of_the_file(version, tensors, rank)
            outcome = node.reader.stats.via
        unchanged = all(torch.equal(raw_bytes(held[k]), before[k]) for k in held)
        if outcome == "delta":
            assert all(held[k].data_ptr() == tensors[k].data_ptr() for k in held)
        else:
            assert unchanged, f"{outcome}: the held tensors changed"
            assert node.reader.base is not None and node.reader.base.version == (
                1 if outcome == "refused" else version.number
            )
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    check()
    assert outcomes.get("full", 0) + outcomes.get("refused", 0) > EXAMPLES // 4, outcomes
