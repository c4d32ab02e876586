"""Profiles: YAML or mappings structured into an EngineConfig, every problem reported."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import uuid

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.config import EngineConfig, KVTransferConfig, SchedulerConfig
from kvwire.config.profile import load_profile, unstructure_engine_config
from kvwire.exceptions import ProfileError

KV_TRANSFER_KEYS = (
    "kv_connector, engine_id, kv_buffer_device, kv_buffer_size, kv_role, kv_rank, "
    "kv_parallel_size, kv_ip, kv_port, kv_connector_extra_config, kv_connector_module_path, "
    "kv_load_failure_policy"
)


def problems_of(profile: object) -> tuple[str, ...]:
    with pytest.raises(ProfileError) as caught:
        load_profile(profile)  # type: ignore[arg-type]
    return caught.value.problems


def test_an_empty_profile_is_the_default_engine_config() -> None:
    config = load_profile({})

    assert config.kv_transfer_config is None
    assert config.cache_config == EngineConfig().cache_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is None


def test_a_yaml_profile_fills_every_section(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "profile.yaml"
    path.write_text(
        "model_config: {num_layers: 4, dtype: bfloat16}\n"
        "cache_config: {block_size: 32}\n"
        "parallel_config: {rank: 1, world_size: 2}\n"
        "scheduler_config: {disable_hybrid_kv_cache_manager: true}\n"
        "kv_transfer_config:\n"
        "  kv_connector: CPUOffloadConnector\n"
        "  kv_role: kv_producer\n"
        "  kv_buffer_size: 2000\n"
        "  kv_connector_extra_config: {cpu_bytes: 1024}\n"
    )

    config = load_profile(path)

    assert config.model_config.num_layers == 4
    assert config.model_config.dtype == "bfloat16"
    assert config.cache_config.block_size == 32
    assert config.parallel_config.rank == 1
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True
    transfer = config.kv_transfer_config
    assert transfer is not None
    assert transfer.kv_connector == "CPUOffloadConnector"
    assert transfer.kv_buffer_size == 2000.0
    assert transfer.get_from_extra_config("cpu_bytes", 0) == 1024
    assert transfer.is_kv_producer and not transfer.is_kv_consumer


def test_a_path_given_as_str_is_read_as_yaml(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "profile.yaml"
    path.write_text("cache_config: {block_size: 8}\n")

    assert load_profile(str(path)).cache_config.block_size == 8


def test_an_empty_yaml_file_is_the_default_engine_config(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")

    assert load_profile(path) == attrs.evolve(EngineConfig())


def test_every_problem_is_listed_with_its_dotted_path() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile(
            {
                "kv_transfer_config": {
                    "kv_connector": "X",
                    "kv_role": "producer",
                    "kv_port": 0,
                    "kv_rank": "a",
                },
                "cache_config": {"block_size": 0, "enable_prefix_caching": "false"},
                "scheduler_config": [1],
            }
        )

    assert str(caught.value) == (
        "invalid profile <mapping> (6 problems):\n"
        "  kv_transfer_config.kv_role: 'producer' is not one of kv_producer, kv_consumer, "
        "kv_both\n"
        "  kv_transfer_config.kv_rank: 'a' is not an integer\n"
        "  kv_transfer_config.kv_port: kv_port must be between 1 and 65535, got 0\n"
        "  cache_config.enable_prefix_caching: 'false' is not true or false\n"
        "  cache_config.block_size: block_size must be > 0, got 0\n"
        "  scheduler_config: expected a mapping of SchedulerConfig fields, got a list"
    )


def test_a_profile_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="invalid profile"):
        load_profile({"cache_config": {"block_size": -1}})


def test_an_unknown_field_is_an_error_with_a_suggestion() -> None:
    assert problems_of({"kv_transfer_config": {"kv_conector": "X"}}) == (
        f"kv_transfer_config.kv_conector: unknown key; accepted keys are {KV_TRANSFER_KEYS} "
        "(did you mean 'kv_connector'?)",
    )


def test_an_unknown_section_is_an_error_with_a_suggestion() -> None:
    assert problems_of({"paralel_config": {}}) == (
        "paralel_config: unknown key; accepted keys are model_config, cache_config, "
        "parallel_config, scheduler_config, kv_transfer_config (did you mean 'parallel_config'?)",
    )


def test_an_unknown_key_with_nothing_close_has_no_suggestion() -> None:
    assert problems_of({"cache_config": {"zzz": 1}}) == (
        "cache_config.zzz: unknown key; accepted keys are block_size, num_gpu_blocks, "
        "enable_prefix_caching, kv_cache_layout",
    )


def test_a_profile_that_is_not_a_mapping_is_an_error() -> None:
    assert problems_of([1]) == (
        "the profile must be a mapping whose keys are model_config, cache_config, "
        "parallel_config, scheduler_config, kv_transfer_config, got a list",
    )


@pytest.mark.parametrize(
    ("section", "field", "value", "expected"),
    [
        ("scheduler_config", "disable_hybrid_kv_cache_manager", "false", "true or false"),
        ("cache_config", "block_size", 3.5, "an integer"),
        ("cache_config", "block_size", True, "an integer"),
        ("kv_transfer_config", "kv_buffer_size", "1e9", "a number"),
        ("kv_transfer_config", "kv_ip", 127, "a string"),
        ("kv_transfer_config", "kv_connector_extra_config", [1], "a mapping with string keys"),
        ("kv_transfer_config", "kv_load_failure_policy", "retry", "one of recompute, fail"),
        ("model_config", "num_layers", None, "an integer"),
    ],
)
def test_a_value_of_the_wrong_kind_is_never_coerced(
    section: str, field: str, value: object, expected: str
) -> None:
    assert problems_of({section: {field: value}}) == (
        f"{section}.{field}: {value!r} is not {expected}",
    )


def test_a_connector_without_a_role_is_reported_at_kv_role() -> None:
    assert problems_of({"kv_transfer_config": {"kv_connector": "X"}}) == (
        "kv_transfer_config.kv_role: Please specify kv_role when kv_connector is set, "
        "supported roles are ('kv_producer', 'kv_consumer', 'kv_both')",
    )


def test_a_check_across_fields_is_reported_at_its_section() -> None:
    assert problems_of({"parallel_config": {"rank": 2}}) == (
        "parallel_config: rank (2) must be < world_size (1)",
    )


def test_an_unreadable_file_is_a_profile_error(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "missing.yaml"

    with pytest.raises(ProfileError) as caught:
        load_profile(missing)

    assert str(caught.value) == (
        f"invalid profile {missing} (1 problem):\n"
        "  cannot read the profile: No such file or directory"
    )


def test_malformed_yaml_is_a_profile_error_with_its_position(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("cache_config: [1,\n")

    (problem,) = problems_of(path)

    assert problem == (
        "not valid YAML: line 2, column 1: expected the node content, but found '<stream end>' "
        "(while parsing a flow node at line 2, column 1)"
    )


def test_yaml_is_read_with_the_safe_loader(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "executed"
    path = tmp_path / "evil.yaml"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")

    (problem,) = problems_of(path)

    assert "could not determine a constructor for the tag" in problem
    assert not marker.exists()


def test_a_null_kv_transfer_config_means_no_connector() -> None:
    assert load_profile({"kv_transfer_config": None}).kv_transfer_config is None


def test_engine_id_defaults_to_a_fresh_uuid_per_config() -> None:
    profile = {"kv_transfer_config": {"kv_connector": "X", "kv_role": "kv_both"}}

    first = load_profile(profile).kv_transfer_config
    second = load_profile(profile).kv_transfer_config

    assert first is not None and second is not None
    assert len(first.engine_id) == 36
    assert first.engine_id != second.engine_id


def test_unstructuring_then_loading_gives_the_same_config() -> None:
    config = load_profile(
        {
            "scheduler_config": {"disable_hybrid_kv_cache_manager": False},
            "kv_transfer_config": {
                "kv_connector": "X",
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"nested": {"a": [1, 2]}},
            },
        }
    )

    assert load_profile(unstructure_engine_config(config)) == config


@given(
    disable=st.sampled_from([True, False, None]),
    role=st.sampled_from(["kv_producer", "kv_consumer", "kv_both"]),
    policy=st.sampled_from(["recompute", "fail"]),
    block_size=st.integers(min_value=1, max_value=1024),
    port=st.integers(min_value=1, max_value=65535),
    buffer_size=st.floats(min_value=1.0, max_value=1e12),
)
def test_any_valid_config_survives_the_round_trip(
    disable: bool | None, role: str, policy: str, block_size: int, port: int, buffer_size: float
) -> None:
    config = EngineConfig(
        scheduler_config=SchedulerConfig(disable_hybrid_kv_cache_manager=disable),
        kv_transfer_config=KVTransferConfig(
            kv_connector="X",
            kv_role=role,  # type: ignore[arg-type]
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
            kv_port=port,
            kv_buffer_size=buffer_size,
        ),
    )
    config = attrs.evolve(
        config, cache_config=attrs.evolve(config.cache_config, block_size=block_size)
    )

    assert load_profile(unstructure_engine_config(config)) == config


def test_null_where_the_default_is_none_means_the_default() -> None:
    config = load_profile(
        {"kv_transfer_config": {"kv_connector": "X", "kv_role": "kv_both", "engine_id": None}}
    )

    assert config.kv_transfer_config is not None
    uuid.UUID(config.kv_transfer_config.engine_id)


# (section, field, bad value, the problem reported for it)
BAD_FIELDS = [
    ("model_config", "num_layers", 0, "model_config.num_layers: num_layers must be > 0, got 0"),
    (
        "model_config",
        "dtype",
        "fp64",
        "model_config.dtype: 'fp64' is not one of "
        "float32, float16, bfloat16, float8_e4m3fn, float8_e5m2",
    ),
    ("cache_config", "block_size", "16", "cache_config.block_size: '16' is not an integer"),
    (
        "parallel_config",
        "world_size",
        -1,
        "parallel_config.world_size: world_size must be > 0, got -1",
    ),
    (
        "scheduler_config",
        "max_num_seqs",
        1.5,
        "scheduler_config.max_num_seqs: 1.5 is not an integer",
    ),
    (
        "kv_transfer_config",
        "kv_port",
        70000,
        "kv_transfer_config.kv_port: kv_port must be between 1 and 65535, got 70000",
    ),
    (
        "kv_transfer_config",
        "kv_rank",
        -2,
        "kv_transfer_config.kv_rank: kv_rank must be >= 0, got -2",
    ),
    (
        "kv_transfer_config",
        "zzz",
        1,
        f"kv_transfer_config.zzz: unknown key; accepted keys are {KV_TRANSFER_KEYS}",
    ),
]


@given(st.sets(st.sampled_from(range(len(BAD_FIELDS))), min_size=1))
def test_every_bad_field_of_any_combination_is_reported(chosen: set[int]) -> None:
    profile: dict[str, dict[str, object]] = {}
    expected = set()
    for index in chosen:
        section, field, value, problem = BAD_FIELDS[index]
        profile.setdefault(section, {})[field] = value
        expected.add(
            problem or f"{section}.{field}: unknown key; accepted keys are {KV_TRANSFER_KEYS}"
        )

    assert set(problems_of(profile)) == expected


def test_a_misplaced_section_is_named_by_its_type_never_echoed() -> None:
    # A URL with a password typed where a section belongs must not reach a log.
    (problem,) = problems_of({"kv_transfer_config": "redis://:hunter2@cache:6379"})

    assert problem == "kv_transfer_config: expected a mapping of KVTransferConfig fields, got a str"
    assert "hunter2" not in problem


# ------------------------------------------------ hostile YAML and NUL bytes

ALIAS_BOMB = (
    'a: &a ["xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx"]\n'
    "b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
    "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
    "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
    "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
    "g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
    "h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
    "model_config: {num_layers: *h}\n"
)


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)

    (problem,) = problems_of(path)

    assert len(ALIAS_BOMB) < 600
    assert problem == (
        "not valid YAML: line 5, column 4: this node expands to more than 10000 values through "
        "its aliases (*name); write the values out, or use fewer aliases"
    )


def test_a_few_aliases_are_still_accepted(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "aliases.yaml"
    path.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: MultiConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    connectors:\n"
        "    - &child {kv_connector: CPUOffloadConnector}\n"
        "    - *child\n"
    )

    transfer = load_profile(path).kv_transfer_config

    assert transfer is not None
    assert transfer.kv_connector_extra_config["connectors"][1] == {
        "kv_connector": "CPUOffloadConnector"
    }


def test_a_recursive_alias_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "recursive.yaml"
    path.write_text("kv_transfer_config:\n  kv_connector_extra_config: &a {me: *a}\n")

    assert problems_of(path) == (
        "not valid YAML: line 2, column 30: an alias (*name) refers to a node that contains it; "
        "a profile cannot be recursive",
    )


def test_nesting_deeper_than_any_profile_is_refused_without_a_recursion_error(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 500 + "]" * 500 + "\n")

    assert problems_of(path) == (
        "not valid YAML: line 1, column 103: nested more than 100 levels deep",
    )


def test_an_integer_of_thousands_of_digits_is_refused_with_its_position(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "long.yaml"
    path.write_text("model_config:\n  seed: 1" + "0" * 5000 + "\n")

    assert problems_of(path) == (
        "not valid YAML: line 2, column 9: an integer of 5001 digits; no setting takes more "
        "than 40",
    )


def test_a_huge_value_of_the_wrong_type_is_shown_cut_with_its_size() -> None:
    (problem,) = problems_of({"model_config": {"num_layers": ["x" * 10] * 1_000_000}})

    assert problem == (
        "model_config.num_layers: ['xxxxxxxxxx', 'xxxxxxxxxx', 'xxxxxxxxxx', 'xxxxxxxxxx', "
        "'xxxxxxxxxx', 'xxxxxxxx... (a list of 1000000 items) is not an integer"
    )


def test_a_long_unknown_key_is_shown_cut() -> None:
    (problem,) = problems_of({"cache_config": {"k" * 10_000: 1}})

    assert problem.startswith(f"cache_config.'{'k' * 79}... (a str of 10000 characters): unknown")


def test_a_profile_with_thousands_of_problems_lists_the_first_fifty() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile({"cache_config": {f"typo{index}": 1 for index in range(1000)}})

    assert len(caught.value.problems) == 1000
    assert str(caught.value).endswith("\n  ... and 950 more (see .problems)")


def test_a_nul_byte_in_the_module_path_is_named_by_its_field() -> None:
    assert problems_of(
        {"kv_transfer_config": {"kv_connector_module_path": "plugins\x00.evil"}}
    ) == (
        "kv_transfer_config.kv_connector_module_path: kv_connector_module_path contains a NUL "
        "byte (\\x00), which no name may hold",
    )


def test_a_nul_byte_in_a_childs_extra_config_path_is_named_by_its_dotted_path() -> None:
    child = {"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv\x00"}}
    profile = {"kv_transfer_config": {"kv_connector_extra_config": {"connectors": [child]}}}

    assert problems_of(profile) == (
        "kv_transfer_config.kv_connector_extra_config: kv_connector_extra_config.connectors[0]"
        ".kv_connector_extra_config.shared_storage_path contains a NUL byte (\\x00), which no "
        "name or path may hold",
    )


def test_a_profile_path_with_a_nul_byte_is_a_profile_error() -> None:
    assert problems_of("/tmp/profile\x00.yaml") == (
        "the profile path contains a NUL byte (\\x00), which no file name can hold",
    )


def test_dev_zero_as_a_profile_is_refused_as_a_character_device() -> None:
    assert problems_of("/dev/zero") == (
        "cannot read the profile: it is a character device, not a regular file; a profile is "
        "a regular YAML file",
    )


def test_a_profile_larger_than_a_megabyte_is_refused_by_its_size(tmp_path: pathlib.Path) -> None:
    # Sparse: a terabyte that takes no disk, refused by its size before a byte is read.
    path = tmp_path / "huge.yaml"
    with path.open("wb") as file:
        file.truncate(2**40)

    assert problems_of(path) == (
        "cannot read the profile: it holds 1099511627776 bytes, more than the 1048576 "
        "accepted; a profile is a regular YAML file",
    )


def test_a_directory_as_a_profile_is_refused_as_one(tmp_path: pathlib.Path) -> None:
    assert problems_of(tmp_path) == (
        "cannot read the profile: it is a directory, not a regular file; a profile is a "
        "regular YAML file",
    )


def test_a_socket_as_a_profile_is_refused_as_one(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "profile.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(path))
        assert problems_of(path) == (
            "cannot read the profile: it is a socket, not a regular file; a profile is a "
            "regular YAML file",
        )


def test_a_fifo_as_a_profile_is_refused_at_once_without_waiting_for_a_writer(
    tmp_path: pathlib.Path,
) -> None:
    fifo = tmp_path / "profile.yaml"
    os.mkfifo(fifo)
    # In a subprocess: reading a FIFO with no writer would block this test forever.
    code = (
        "import sys; from kvwire.config.profile import load_profile\n"
        "try: load_profile(sys.argv[1])\n"
        "except Exception as error: print(error)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60
    )
    assert "cannot read the profile: it is a FIFO (named pipe), not a regular file" in (
        result.stdout
    )


def test_a_key_written_twice_in_one_mapping_is_refused_with_both_lines(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(
        "kv_transfer_config:\n"
        "  kv_connector: CPUOffloadConnector\n"
        "  kv_role: kv_producer\n"
        "  kv_role: kv_both\n"
    )

    assert problems_of(path) == (
        "not valid YAML: line 4, column 3: the key kv_role appears twice in one mapping "
        "(first at line 3); a mapping holds each key once",
    )


def test_a_key_a_merge_brings_in_may_be_overridden(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "merged.yaml"
    path.write_text(
        "cache_config:\n"
        "  block_size: 4\n"
        "  num_gpu_blocks: 64\n"
        "kv_transfer_config:\n"
        "  kv_connector: CPUOffloadConnector\n"
        "  kv_role: kv_both\n"
        "  kv_connector_extra_config:\n"
        "    <<: {io_threads: 1, cpu_pool_bytes: 1MiB}\n"
        "    io_threads: 2\n"
    )

    transfer = load_profile(path).kv_transfer_config
    assert transfer is not None
    assert transfer.kv_connector_extra_config == {"io_threads": 2, "cpu_pool_bytes": "1MiB"}
