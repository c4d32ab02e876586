"""A model's identity: equal for equal weights wherever they live, different once they change."""

from __future__ import annotations

import json
import mmap
import os
import pathlib

import pytest

from kvwire.config import ModelConfig
from kvwire.config.profile import load_profile
from kvwire.identity.file_digests import UNCACHED_BYTES, FileDigests, FileStamp
from kvwire.identity.model import (
    ModelIdentityError,
    UnreadableWeightsError,
    model_identity,
    weight_stamps,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Several MiB, past what is read at each call (UNCACHED_BYTES), so its digest is remembered.
WEIGHTS_BYTES = 7 * 1024 * 1024 + 17


@pytest.fixture(autouse=True)
def private_digest_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's remembered file digests in its own directory, not the user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def save_model(directory: pathlib.Path, weights: bytes | None = None) -> pathlib.Path:
    """A model directory as vLLM reads one: config, a large weight file, a tokenizer."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"hidden_size": 128, "num_layers": 2}))
    if weights is None:
        weights = (bytes(range(251)) * (WEIGHTS_BYTES // 251 + 1))[:WEIGHTS_BYTES]
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "tokenizer.json").write_text("{}")
    return directory


def weights_of(directory: pathlib.Path) -> bytearray:
    return bytearray((directory / "model.safetensors").read_bytes())


def test_same_weights_in_two_directories_have_one_identity(tmp_path: pathlib.Path) -> None:
    first = save_model(tmp_path / "host-a" / "models" / "x")
    second = save_model(tmp_path / "elsewhere" / "y")
    assert model_identity(str(first)) == model_identity(str(second))
    assert model_identity(str(first)).startswith("weights:")


def test_relative_path_model_in_two_working_directories_differs(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = save_model(tmp_path / "a" / "model")
    weights = weights_of(first)
    weights[1024 * 1024 // 2] ^= 1
    save_model(tmp_path / "b" / "model", bytes(weights))
    monkeypatch.chdir(tmp_path / "a")
    in_a = model_identity("model")
    monkeypatch.chdir(tmp_path / "b")
    assert model_identity("model") != in_a


def flip_byte(path: pathlib.Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_one_byte_changed_anywhere_in_a_weight_file_changes_the_identity(
    tmp_path: pathlib.Path,
) -> None:
    # Offsets between any fixed sample's pieces, as a fine-tune of a few
    # tensors changes, and the file's first and last bytes.
    offsets = [0, 2 * 1024 * 1024 + 5, 3 * 1024 * 1024 + 70_001, WEIGHTS_BYTES - 1]
    model = save_model(tmp_path / "model")
    original = model_identity(str(model))
    seen = {original}
    for offset in offsets:
        flip_byte(model / "model.safetensors", offset)
        changed = model_identity(str(model))
        assert changed not in seen, offset
        seen.add(changed)
        flip_byte(model / "model.safetensors", offset)
    assert model_identity(str(model)) == original


def test_a_fine_tune_saved_fresh_that_changes_middle_tensors_differs_from_its_base(
    tmp_path: pathlib.Path,
) -> None:
    base = save_model(tmp_path / "base")
    tuned_weights = weights_of(base)
    middle = WEIGHTS_BYTES // 2 + 12_345
    tuned_weights[middle : middle + 4096] = bytes(4096)
    tuned = save_model(tmp_path / "tuned", bytes(tuned_weights))
    assert model_identity(str(base)) != model_identity(str(tuned))


def test_a_changed_size_or_config_changes_the_identity(tmp_path: pathlib.Path) -> None:
    original = save_model(tmp_path / "original")
    longer = save_model(tmp_path / "longer", bytes(weights_of(original)) + b"\0")
    reconfigured = save_model(tmp_path / "reconfigured")
    (reconfigured / "config.json").write_text(json.dumps({"hidden_size": 128, "num_layers": 3}))
    identities = {model_identity(str(path)) for path in (original, longer, reconfigured)}
    assert len(identities) == 3


def test_a_small_weight_file_is_read_whole(tmp_path: pathlib.Path) -> None:
    original = save_model(tmp_path / "original", b"\1" * 1000)
    changed = save_model(tmp_path / "changed", b"\1" * 999 + b"\2")
    assert model_identity(str(original)) != model_identity(str(changed))


def test_the_tokenizer_and_other_files_take_no_part(tmp_path: pathlib.Path) -> None:
    original = save_model(tmp_path / "original")
    other = save_model(tmp_path / "other")
    (other / "tokenizer.json").write_text('{"other": 1}')
    for name in (
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.json",
    ):
        (other / name).write_text('{"other": 1}')
    (other / "README.md").write_text("a model card")
    assert model_identity(str(original)) == model_identity(str(other))


@pytest.mark.parametrize(
    "name",
    [
        "hf_quant_config.json",
        "quantize_config.json",
        "quant_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "sparse_attention_config.json",
    ],
)
def test_a_configuration_file_vllm_computes_with_is_part_of_the_identity(
    tmp_path: pathlib.Path, name: str
) -> None:
    identities = {model_identity(str(save_model(tmp_path / "without")))}
    for bits in (4, 8):
        model = save_model(tmp_path / f"bits-{bits}")
        (model / name).write_text(json.dumps({"bits": bits}))
        identities.add(model_identity(str(model)))
    assert len(identities) == 3


def test_weights_of_a_format_not_known_here_are_digested_too(tmp_path: pathlib.Path) -> None:
    identities = set()
    for name, weights in (("a", b"one model"), ("b", b"another model")):
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text("{}")
        (model / "weights.npz").write_bytes(weights)
        identities.add(model_identity(str(model)))
    assert len(identities) == 2


def test_the_explicit_identity_wins_over_files_and_hub_ids(tmp_path: pathlib.Path) -> None:
    first = save_model(tmp_path / "first")
    second = save_model(tmp_path / "second", b"other weights")
    assert model_identity(str(first), explicit="acme-ft-7") == "explicit:acme-ft-7"
    assert model_identity(str(second), explicit="acme-ft-7") == "explicit:acme-ft-7"
    assert model_identity("org/unknown-model", explicit="acme-ft-7") == "explicit:acme-ft-7"


def hub_cache(tmp_path: pathlib.Path, repo: str, refs: dict[str, str]) -> pathlib.Path:
    cache = tmp_path / "hub"
    folder = cache / ("models--" + repo.replace("/", "--"))
    for ref, commit in refs.items():
        save_model(folder / "snapshots" / commit)
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return cache


def test_a_hub_snapshot_directory_is_identified_by_its_files_not_its_commit(
    tmp_path: pathlib.Path,
) -> None:
    cache = hub_cache(tmp_path, "org/model", {"main": COMMIT})
    snapshot = cache / "models--org--model" / "snapshots" / COMMIT
    copy = save_model(tmp_path / "copy")
    assert model_identity(str(snapshot)) == model_identity(str(copy))
    # A snapshot edited in place keeps its commit's name, not its identity.
    flip_byte(snapshot / "model.safetensors", WEIGHTS_BYTES // 2)
    assert model_identity(str(snapshot)) != model_identity(str(copy))
    # A hub id is its commit: a worker may start before its files are downloaded.
    assert model_identity("org/model", hub_caches=[str(cache)]) == f"hub-commit:{COMMIT}"


def test_a_hub_id_with_a_commit_revision_is_that_commit(tmp_path: pathlib.Path) -> None:
    assert model_identity("org/model", COMMIT, hub_caches=[str(tmp_path)]) == (
        f"hub-commit:{COMMIT}"
    )


def test_a_hub_id_s_branch_resolves_to_the_downloaded_commit(tmp_path: pathlib.Path) -> None:
    other = "f" * 40
    cache = hub_cache(tmp_path, "org/model", {"main": COMMIT, "v2": other})
    assert model_identity("org/model", "v2", hub_caches=[str(cache)]) == f"hub-commit:{other}"


def test_a_hub_id_without_a_local_commit_is_refused_naming_the_field(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelIdentityError, match=r"model_config\.identity.*'org/model'"):
        model_identity("org/model", "main", hub_caches=[str(tmp_path / "empty-cache")])
    # A ref naming a snapshot that is not there is no commit either.
    cache = hub_cache(tmp_path, "org/model", {"main": COMMIT})
    (cache / "models--org--model" / "refs" / "main").write_text("e" * 40)
    with pytest.raises(ModelIdentityError, match="revision 'main'"):
        model_identity("org/model", hub_caches=[str(cache)])


def test_unreadable_weights_are_refused_naming_the_field_and_the_file(
    tmp_path: pathlib.Path,
) -> None:
    model = save_model(tmp_path / "model", b"weights")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(
        UnreadableWeightsError, match=r"model_config\.identity: cannot read.*'model.safetensors'"
    ):
        model_identity(str(model))


def test_a_fifo_named_like_a_weight_file_is_refused_without_waiting(
    tmp_path: pathlib.Path,
) -> None:
    model = save_model(tmp_path / "model", b"weights")
    os.mkfifo(model / "extra.safetensors")
    with pytest.raises(UnreadableWeightsError, match="not a regular file"):
        model_identity(str(model))


def test_an_adapter_s_config_is_part_of_its_identity(tmp_path: pathlib.Path) -> None:
    identities = set()
    for name, alpha in (("a", 16), ("b", 32)):
        adapter = tmp_path / name
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": alpha}))
        (adapter / "adapter_model.safetensors").write_bytes(b"the same adapter weights")
        identities.add(model_identity(str(adapter)))
    assert len(identities) == 2


@pytest.mark.parametrize("identity", ["a\nb", " padded", "x" * 257, "tab\there"])
def test_a_bad_explicit_identity_is_refused_naming_the_field(identity: str) -> None:
    with pytest.raises(ValueError, match=r"model_config\.identity: .*printable one-line"):
        load_profile({"model_config": {"identity": identity}})


def test_kvwire_s_engine_is_identified_by_what_draws_its_weights() -> None:
    assert ModelConfig(seed=1).weights_identity != ModelConfig(seed=2).weights_identity
    assert ModelConfig(seed=1).weights_identity == ModelConfig(seed=1).weights_identity
    assert ModelConfig(seed=1, identity="named").weights_identity == "named"


def test_with_the_digest_cache_off_an_edit_through_a_live_mapping_changes_the_identity(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWIRE_DIGEST_CACHE", "off")
    model = save_model(tmp_path / "model")
    weights = model / "model.safetensors"
    offset = WEIGHTS_BYTES // 2
    with open(weights, "r+b") as file, mmap.mmap(file.fileno(), 0) as mapping:
        mapping[offset] ^= 0xFF
        stamp = FileStamp.of(os.stat(weights))
        original = model_identity(str(model), file_digests=FileDigests(settle_ns=0))
        # A page the mapping has written already takes more writes without a
        # fault: the kernel updates no time, which a stat-keyed cache cannot see.
        mapping[offset + 1] ^= 0xFF
        assert FileStamp.of(os.stat(weights)) == stamp
        assert model_identity(str(model), file_digests=FileDigests(settle_ns=0)) != original


def test_files_unchanged_since_they_were_stamped_have_the_identity_they_have_unstamped(
    tmp_path: pathlib.Path,
) -> None:
    model = save_model(tmp_path / "model")
    stamps = weight_stamps(str(model))
    assert sorted(stamps) == ["config.json", "model.safetensors"]
    assert model_identity(str(model), stamps=stamps) == model_identity(str(model))


def test_a_weight_file_renamed_over_after_it_was_stamped_is_refused_naming_it(
    tmp_path: pathlib.Path,
) -> None:
    model = save_model(tmp_path / "model")
    stamps = weight_stamps(str(model))
    # A new file of the same size, as save_pretrained writes one and renames it into place.
    new = tmp_path / "new.safetensors"
    new.write_bytes(bytes(WEIGHTS_BYTES))
    new.replace(model / "model.safetensors")
    with pytest.raises(
        UnreadableWeightsError,
        match=r"model_config\.identity: the model's file 'model.safetensors' .* changed after "
        "the engine's configuration was built",
    ):
        model_identity(str(model), stamps=stamps)


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_file_added_or_removed_after_stamping_is_refused_naming_it(
    tmp_path: pathlib.Path, change: str
) -> None:
    model = save_model(tmp_path / "model")
    (model / "model-extra.safetensors").write_bytes(b"a shard")
    if change == "added":
        (model / "model-extra.safetensors").unlink()
    stamps = weight_stamps(str(model))
    if change == "added":
        (model / "model-extra.safetensors").write_bytes(b"a shard")
    else:
        (model / "model-extra.safetensors").unlink()
    appeared = "appeared" if change == "added" else "disappeared"
    with pytest.raises(UnreadableWeightsError, match=rf"'model-extra\.safetensors' .* {appeared}"):
        model_identity(str(model), stamps=stamps)


def test_a_file_unreadable_when_stamped_and_readable_now_is_refused_naming_it(
    tmp_path: pathlib.Path,
) -> None:
    model = save_model(tmp_path / "model", b"weights")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(tmp_path / "later")
    stamps = weight_stamps(str(model))
    assert stamps["model.safetensors"] is None
    (tmp_path / "later").write_bytes(b"weights")
    with pytest.raises(UnreadableWeightsError, match=r"'model\.safetensors' .* changed after"):
        model_identity(str(model), stamps=stamps)


def test_a_model_of_more_weight_files_than_the_cache_bound_is_read_once(
    tmp_path: pathlib.Path,
) -> None:
    model = save_model(tmp_path / "model")
    for index in range(20):
        with open(model / f"model-{index:05d}-of-00020.safetensors", "wb") as shard:
            shard.truncate(UNCACHED_BYTES + 1)
    first_start = FileDigests(settle_ns=0, max_entries=8)
    identity = model_identity(str(model), file_digests=first_start)
    assert first_start.files_read == 22
    second_start = FileDigests(settle_ns=0, max_entries=8)
    assert model_identity(str(model), file_digests=second_start) == identity
    # config.json is read at every start: it is too small to be remembered.
    assert second_start.files_read == 1
