"""A node opens only plain, listed, regular files inside its version directory, and every
malformed version is a WeightsError naming the file and the problem.

Hostile versions are copies of a real published version, changed one way each and registered
in the real Redis; the outside directory holds whole, valid copies of the version's files (so
following any path there would have succeeded), and the kernel (inotify) says whether any of
them was opened.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import WeightsError
from weightcast.contract.manifest import MANIFEST_NAME, sha256_file

from helpers.files import OpenWatch
from helpers.versions import Deployment, copy_version, redigest, register_version


@pytest.fixture
def outside(deployment: Deployment, tmp_path: Path) -> Iterator[Path]:
    """Valid copies of v1's files outside the weights root, watched by the kernel."""
    path = tmp_path / "outside"
    shutil.copytree(tmp_path / "weights" / "v1", path)
    watch = OpenWatch(path)
    yield path
    touched = watch.touched()
    watch.close()
    assert touched == [], f"files outside the weights root were opened: {touched}"


def edit_manifest(directory: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    change(manifest)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def grow_first_file(manifest: dict) -> None:
    """The first file one byte longer than it is, in a manifest that is valid otherwise (a
    block list of per-block lengths gains a one-byte block)."""
    entry = manifest["files"][0]
    entry["bytes"] += 1
    if (entry.get("blocks") or {}).get("lengths"):
        entry["blocks"]["lengths"].append(1)
        entry["blocks"]["digests"].append("0" * 32)


def point_tensors_at(name: str) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        for tensor in manifest["tensors"]:
            tensor["file"] = name

    return change


def list_hf_copy(directory: Path, outside: Path) -> None:
    """``hf/`` is a link out, and the manifest lists (with its right digest) and uses a file
    in it: the kind of name ``--layout both`` lists for other readers."""
    os.symlink(outside, directory / "hf")
    same = directory / "model.vllm-fused"  # the outside copy's bytes, read from inside
    entry = {"name": "hf/model.vllm-fused", "bytes": same.stat().st_size}
    entry["sha256"] = sha256_file(same)

    def change(manifest: dict) -> None:
        manifest["files"].append(entry)
        point_tensors_at("hf/model.vllm-fused")(manifest)

    edit_manifest(directory, change)


HOSTILE = {
    "tensor file with ..": (
        lambda v, out: edit_manifest(v, point_tensors_at("../../outside/model.vllm-fused")),
        r"names the file '\.\./\.\./outside/model\.vllm-fused': not a plain file name",
    ),
    "absolute tensor file": (
        lambda v, out: edit_manifest(v, point_tensors_at(str(out / "model.vllm-fused"))),
        r"not a plain file name",
    ),
    "tensor file in a listed subdirectory (hf/)": (
        lambda v, out: list_hf_copy(v, out),
        r"names the file 'hf/model\.vllm-fused': not a plain file name",
    ),
    "tensor file not listed": (
        lambda v, out: (
            shutil.copy(v / "model.vllm-fused", v / "other.safetensors"),
            edit_manifest(v, point_tensors_at("other.safetensors")),
        ),
        r"other\.safetensors', a file the manifest does not list",
    ),
    "weights file is a symlink out": (
        lambda v, out: (
            os.unlink(v / "model.vllm-fused"),
            os.symlink(out / "model.vllm-fused", v / "model.vllm-fused"),
        ),
        r"model\.vllm-fused: a symbolic link; refusing to follow it",
    ),
    "weights file is a FIFO": (
        lambda v, out: (os.unlink(v / "model.vllm-fused"), os.mkfifo(v / "model.vllm-fused")),
        r"model\.vllm-fused: not a regular file",
    ),
    "weights file is a directory": (
        lambda v, out: (os.unlink(v / "model.vllm-fused"), os.mkdir(v / "model.vllm-fused")),
        r"model\.vllm-fused: not a regular file",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_manifest_or_file_is_refused_and_nothing_outside_is_opened(
    deployment: Deployment, outside: Path, case: str
) -> None:
    change, message = HOSTILE[case]
    number, directory = copy_version(deployment, 1)
    change(directory, outside)
    register_version(deployment, number, like=1)
    reader = deployment.reader()
    result: list[BaseException] = []

    def read() -> None:  # a thread, so that a hang (a FIFO opened blocking) fails the test
        for call in (reader.load, lambda v: reader.rank_tensors(v, 1, 2), reader.verify):
            try:
                call(number)
            except BaseException as exc:
                result.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "reading the version hung"
    assert len(result) == 3
    for exc in result:
        assert isinstance(exc, WeightsError), repr(exc)
        assert str(exc).startswith(str(directory)) or MANIFEST_NAME in str(exc), str(exc)
        assert re.search(message, str(exc)), str(exc)


def test_a_symlinked_manifest_or_config_is_refused(deployment: Deployment, outside: Path) -> None:
    for name in (MANIFEST_NAME, "config.json"):
        number, directory = copy_version(deployment, 1)
        os.unlink(directory / name)
        os.symlink(outside / name, directory / name)
        register_version(deployment, number, like=1)
        # The registry holds the outside manifest's digest: following the link would pass.
        deployment.client.hset(
            deployment.keys.version(number),
            "manifest_sha256",
            deployment.client.hget(deployment.keys.version(1), "manifest_sha256"),
        )
        reader = deployment.reader()
        for call in (reader.config, reader.load, reader.manifest):
            with pytest.raises(WeightsError, match=f"{name}: a symbolic link"):
                call(number)
            if name == "config.json":
                break  # load and manifest do not open config.json


def test_registered_paths_resolve_inside_the_weights_root_only(
    deployment: Deployment, outside: Path, tmp_path: Path
) -> None:
    weights = tmp_path / "weights"
    (weights / "v77").symlink_to(outside, target_is_directory=True)
    refused = {
        str(outside): "outside the weights root",
        "../outside": "is not plain names below the weights root",
        "v1/../../outside": "is not plain names below the weights root",
        f"{weights}/../outside": "is not plain names below the weights root",
        "": "needs a path",
        "v77": r"version directory .*v77: a symbolic link",
        "v1/model.vllm-fused": "cannot open it: Not a directory",
    }
    reader = deployment.reader()
    for path, message in refused.items():
        deployment.client.hset(deployment.keys.version(1), "path", path)
        with pytest.raises(WeightsError, match=message):
            reader.config(1)
    # Relative (what the publisher writes now) and absolute inside the root (older
    # publishers), also through a symlink to the root as the node is configured with.
    link = tmp_path / "weights-link"
    link.symlink_to(weights, target_is_directory=True)
    via_link = WeightsClient(
        deployment.redis_url, link, namespace=deployment.keys.namespace, node_id="n"
    )
    for path in ("v1", str(weights / "v1"), str(link / "v1")):
        deployment.client.hset(deployment.keys.version(1), "path", path)
        assert via_link.config(1)["num_attention_heads"] == 4
        assert via_link.reader.path(via_link.info(1)) == weights.resolve() / "v1"
        if path.startswith(str(link)):  # a way in this node was not told about
            with pytest.raises(WeightsError, match="outside the weights root"):
                reader.config(1)
        else:
            assert reader.config(1)["num_attention_heads"] == 4


def safetensors_prefix(directory: Path) -> tuple[int, dict]:
    data = (directory / "model.vllm-fused").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


def write_header(directory: Path, header: dict, length: int | None = None) -> None:
    """Replace the header of ``model.vllm-fused`` keeping its data where it was."""
    path = directory / "model.vllm-fused"
    data = path.read_bytes()
    (old,) = struct.unpack("<Q", data[:8])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= old, "the new header must fit in the old one's place"
    text += b" " * (old - len(text))
    path.write_bytes(struct.pack("<Q", old if length is None else length) + text + data[8 + old :])


def garble_header(directory: Path) -> None:
    path = directory / "model.vllm-fused"
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + length] = b"{" + b"x" * (length - 1)
    path.write_bytes(bytes(data))


def nest_header(directory: Path) -> None:
    """A header of nothing but ``[``: JSON nested deeper than Python's recursion limit."""
    path = directory / "model.vllm-fused"
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    assert length > sys.getrecursionlimit(), "the header must nest deeper than that"
    data[8 : 8 + length] = b"[" * length
    path.write_bytes(bytes(data))


def first_tensor(header: dict) -> str:
    return next(name for name in header if name != "__metadata__")


def grow_shape(header: dict) -> None:
    """A 2**62-element tensor whose offsets agree with its shape (room made by dropping the
    metadata)."""
    del header["__metadata__"]
    name = first_tensor(header)
    header[name]["shape"] = [2**62]
    begin = header[name]["data_offsets"][0]
    header[name]["data_offsets"] = [begin, begin + 2**62 * 2]


def shift_offsets(header: dict) -> None:
    header[first_tensor(header)]["data_offsets"][1] += 2


def unknown_dtype(header: dict) -> None:
    header[first_tensor(header)]["dtype"] = "F128"


MALFORMED_FILES = {
    "header length 2**62": (
        lambda v: write_header(v, safetensors_prefix(v)[1], length=2**62),
        r"model\.vllm-fused: safetensors header claims 4611686018427387904 bytes",
    ),
    "header not JSON": (
        lambda v: garble_header(v),
        r"model\.vllm-fused: safetensors header is not JSON",
    ),
    "header nested too deep": (nest_header, r"model\.vllm-fused: safetensors header is not JSON"),
    "tensor of 2**62 elements": (
        lambda v: write_header(v, _changed(safetensors_prefix(v)[1], grow_shape)),
        r"model\.vllm-fused: .* end past the file",
    ),
    "offsets that do not fit the shape": (
        lambda v: write_header(v, _changed(safetensors_prefix(v)[1], shift_offsets)),
        r"model\.vllm-fused: .* hold \d+ bytes, its shape .* needs \d+",
    ),
    "unknown dtype": (
        lambda v: write_header(v, _changed(safetensors_prefix(v)[1], unknown_dtype)),
        r"model\.vllm-fused: .* unknown dtype 'F128'",
    ),
    "config not JSON": (
        lambda v: (v / "config.json").write_text("{'not': json"),
        r"config\.json is not JSON",
    ),
    "config nested too deep": (
        lambda v: (v / "config.json").write_text("[" * 100_000),
        r"config\.json is not JSON",
    ),
    "config not an object": (
        lambda v: (v / "config.json").write_text("[1, 2]"),
        r"config\.json is not a JSON object",
    ),
}


def _changed(header: dict, change: Callable[[dict], None]) -> dict:
    change(header)
    return header


@pytest.mark.parametrize("case", list(MALFORMED_FILES))
def test_a_malformed_file_that_passes_its_digests_is_a_weights_error(
    deployment: Deployment, case: str
) -> None:
    change, message = MALFORMED_FILES[case]
    number, directory = copy_version(deployment, 1)
    change(directory)
    redigest(directory, block_bytes=4096)  # the damage is in the manifest: digests pass
    register_version(deployment, number, like=1)
    reader = deployment.reader()
    with pytest.raises(WeightsError, match=message) as caught:
        reader.config(number)
        reader.load(number)
    assert str(directory) in str(caught.value)


MALFORMED_MANIFESTS = {
    "not JSON": (lambda v: (v / MANIFEST_NAME).write_text("{oops"), "not a valid manifest"),
    "a JSON list": (lambda v: (v / MANIFEST_NAME).write_text("[]"), "not a valid manifest"),
    "nested too deep": (
        lambda v: (v / MANIFEST_NAME).write_text("[" * 100_000),
        "not a valid manifest",
    ),
    "no tensors": (
        lambda v: edit_manifest(v, lambda m: m.pop("tensors")),
        r"not a valid manifest \(lacks 'tensors'\)",
    ),
    "unknown format": (
        lambda v: edit_manifest(v, lambda m: m.update(format="weightcast.manifest/9")),
        "manifest format 'weightcast.manifest/9' is not one this weightcast reads "
        r"\(weightcast.manifest/1, weightcast.manifest/2, weightcast.manifest/3\): upgrade",
    ),
    "a file's size is wrong": (
        lambda v: edit_manifest(v, grow_first_file),
        r"\d+ bytes, the manifest says \d+",
    ),
    "no config listed": (
        lambda v: edit_manifest(
            v, lambda m: m.update(files=[f for f in m["files"] if f["name"] != "config.json"])
        ),
        "lists no config.json",
    ),
    "a tensor listed twice": (
        lambda v: edit_manifest(v, lambda m: m["tensors"].append(m["tensors"][0])),
        "lists a tensor twice",
    ),
    "a tensor's shape is not a list of sizes": (
        lambda v: edit_manifest(v, lambda m: m["tensors"][0].update(shape="big")),
        r"tensors\[0\]\.shape is 'big', not a list of integers >= 0",
    ),
    "too big to read": (
        lambda v: os.truncate(v / MANIFEST_NAME, 65 * 1024 * 1024),
        r"manifest\.json: 68157440 bytes, more than the 67108864",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED_MANIFESTS))
def test_a_malformed_manifest_is_a_weights_error(deployment: Deployment, case: str) -> None:
    change, message = MALFORMED_MANIFESTS[case]
    number, directory = copy_version(deployment, 1)
    change(directory)
    register_version(deployment, number, like=1)  # the registry holds the broken one's digest
    with pytest.raises(WeightsError, match=message) as caught:
        deployment.reader().load(number)
    assert str(directory) in str(caught.value) or MANIFEST_NAME in str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("path", None, "registry entry of version 1 has no 'path'"),
        ("tp", "two", "registry entry of version 1: tp is 'two', not a int"),
        ("manifest_sha256", "abc", "needs a path and a 64-digit manifest_sha256"),
        ("manifest_sha256", "z" * 64, "needs a path and a 64-digit manifest_sha256"),
        ("tp", "0", "registry entry of version 1: tp is 0, not >= 1"),
        ("step", "-1", "registry entry of version 1: step is '-1', not a int"),
        ("bytes", "1_000", "registry entry of version 1: bytes is '1_000', not a int"),
        ("bytes", " 7", "registry entry of version 1: bytes is ' 7', not a int"),
        ("created_at", "nan", "registry entry of version 1: created_at is 'nan', not a float"),
    ],
)
def test_a_malformed_registry_entry_is_a_weights_error(
    deployment: Deployment, field: str, value: str | None, message: str
) -> None:
    if value is None:
        deployment.client.hdel(deployment.keys.version(1), field)
    else:
        deployment.client.hset(deployment.keys.version(1), field, value)
    reader = deployment.reader()
    with pytest.raises(WeightsError, match=message):
        reader.info(1)
    with pytest.raises(WeightsError, match=message), reader.lease(1):
        pass
