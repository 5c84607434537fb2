"""The CLI's flags are built from EngineConfig and ServerConfig: same defaults, one flag per field,
and sizes read the way the whole project reads them."""

from __future__ import annotations

import dataclasses

import pytest

from loader import parse_size
from runtime.config import CacheConfig, EngineConfig, section_of_field
from scheduler import SchedulerConfig
from server.cli import build_parser, engine_config, parse_args, server_config
from server.config import ServerConfig


def test_cli_defaults_equal_the_configs_defaults():
    args = parse_args([])
    assert engine_config(args) == EngineConfig()
    assert server_config(args) == ServerConfig()


def test_every_setting_has_a_flag():
    dests = {a.dest for a in build_parser()._actions}
    assert set(section_of_field()) <= dests
    assert {f.name for f in dataclasses.fields(ServerConfig)} <= dests


def test_flags_reach_the_nested_config():
    args = parse_args(
        [
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "128",
            "--policy",
            "fcfs",
            "--no-prefix-caching",
            "--dtype",
            "float32",
            "--kv-cache-bytes",
            "256MiB",
            "--num-threads",
            "2",
        ]
    )
    config = engine_config(args)
    assert config.scheduler == dataclasses.replace(
        SchedulerConfig(),
        max_num_seqs=8,
        max_num_batched_tokens=128,
        policy="fcfs",
        enable_prefix_caching=False,
    )
    assert config.model.dtype == "float32"
    assert config.cache.kv_cache_bytes == 256 << 20
    assert config.parallel.num_threads == 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1G", 1 << 30),
        ("1GiB", 1 << 30),
        ("1GB", 10**9),
        ("512M", 512 << 20),
        ("512MB", 512 * 10**6),
        ("1073741824", 1 << 30),
    ],
)
def test_one_size_reading_everywhere(text, expected):
    assert parse_size(text, "x") == expected  # the loader's options
    assert CacheConfig(text).kv_cache_bytes == expected  # the engine's config
    assert parse_args(["--kv-cache-bytes", text]).kv_cache_bytes == expected  # the server's flag


def test_bad_settings_name_the_field():
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-bytes", "lots"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig().replace(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seq:"):
        EngineConfig().replace(max_num_seq=8)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        CacheConfig(0)


def test_api_key_repeats_and_sits_beside_the_keys_file(tmp_path):
    from server.auth import Tenant, api_keys

    args = parse_args(["--api-key", "k1", "--api-key", "k2"])
    assert server_config(args).api_key == ["k1", "k2"]
    path = tmp_path / "keys.json"
    path.write_text('{"k2": {"tenant": "b"}, "k3": {"tenant": "c"}}')
    keys = api_keys(str(path), ["k1", "k2"])
    assert keys == {"k1": None, "k2": Tenant("b"), "k3": Tenant("c")}  # the file's k2 keeps its tenant
    assert api_keys(None, []) is None
    with pytest.raises(ValueError, match="--api-key"):
        api_keys(None, [" "])
