"""gateway.config: sizes, loading and precedence, strict keys, LMCache mapping, secrets."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.config import (
    BreakerConfig,
    Config,
    RetryConfig,
    StoreConfig,
    TierConfig,
    default_data_dir,
    default_tiers,
    dump_config,
    is_secret_key,
    load_config,
    load_lmcache_env,
    map_lmcache_config,
    parse_size,
    redact_url,
)
from gateway.errors import ConfigError, GatewayError

GiB = 1024**3
MiB = 1024**2
SECRET = "hunter2-s3cr3t"  # distinctive, so a substring check cannot match by accident


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def config_error(source: Any = None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, env={} if env is None else env)
    return str(info.value)


# --- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        (2.0, 2),
        ("4096", 4096),
        ("10B", 10),
        ("10 b", 10),
        ("64k", 64 * 1024),
        ("64K", 64 * 1024),
        ("64KiB", 64 * 1024),
        ("64ki", 64 * 1024),
        ("64kb", 64_000),
        ("512MiB", 512 * MiB),
        ("512M", 512 * MiB),
        ("100MB", 100_000_000),
        ("4GiB", 4 * GiB),
        ("4gib", 4 * GiB),
        ("4G", 4 * GiB),
        ("100GB", 100 * 10**9),
        ("1.5GiB", 3 * GiB // 2),
        (".5k", 512),
        ("1.1KiB", 1126),  # fractions of a unit round down to whole bytes
        ("2TiB", 2 * 1024**4),
        ("3TB", 3 * 10**12),
        ("  1 GiB ", GiB),
    ],
)
def test_parse_size_accepts(text: int | float | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    ["-1", -1, -1.0, "", "abc", "GiB", "1.5", "0.5B", "4iB", "4 GiBs", "1e3", "4PB", "1,5G", True],
)
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)


@given(n=st.integers(min_value=0, max_value=10**6), unit=st.sampled_from(list("kKmMgGtT")))
def test_parse_size_units_property(n: int, unit: str) -> None:
    power = "kmgt".index(unit.lower()) + 1
    assert parse_size(f"{n}{unit}") == n * 1024**power
    assert parse_size(f"{n}{unit}iB") == n * 1024**power
    assert parse_size(f"{n}{unit}B") == n * 1000**power


def test_byte_size_fields_take_strings() -> None:
    cfg = load_config(
        {"tiers": [{"url": "memory://", "capacity": "1.5GiB"}], "staging": "64MiB"}, env={}
    )
    assert cfg.tiers[0].capacity == 3 * GiB // 2
    assert cfg.staging == 64 * MiB
    assert StoreConfig(tiers=[TierConfig(url="memory://")]).staging == 256 * MiB


def test_byte_size_field_errors_name_the_key() -> None:
    msg = config_error({"tiers": [{"url": "memory://", "capacity": "-3GiB"}]})
    assert "tiers.0.capacity:" in msg
    assert "negative" in msg
    msg = config_error({"tiers": [{"url": "memory://"}], "staging": "lots"})
    assert "staging: malformed size 'lots'" in msg


# --- defaults -----------------------------------------------------------------------------------


def test_defaults_are_two_embedded_tiers(tmp_path: Path) -> None:
    cfg = load_config(env={"KVGATE_DATA_DIR": str(tmp_path)})
    assert [t.url for t in cfg.tiers] == ["memory://", f"file://{tmp_path}"]
    assert [t.capacity for t in cfg.tiers] == [2 * GiB, 20 * GiB]
    assert cfg.tiers[0].eviction == "lru"
    assert (cfg.chunk_size, cfg.save_partial_chunks, cfg.staging) == (256, False, 256 * MiB)
    assert (cfg.prefetch_deadline, cfg.pin_memory) == (10.0, None)


def test_tier_defaults() -> None:
    tier = TierConfig(url="memory://")
    assert tier.scheme == "memory"
    assert (tier.name, tier.capacity, tier.eviction, tier.codec) == (None, None, "lru", "raw")
    assert (tier.codec_options, tier.options, tier.timeout, tier.ttl) == ({}, {}, 5.0, None)
    assert tier.retry == RetryConfig(attempts=2, backoff_base=0.02, backoff_max=0.5)
    assert tier.breaker == BreakerConfig(failures=5, reset_after=5.0)
    assert (tier.concurrency, tier.queue_size, tier.workers) == (16, 64, 4)
    assert tier.backpressure == "wait"


def test_default_data_dir_rules(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    assert default_data_dir({"KVGATE_DATA_DIR": str(tmp_path), "XDG_DATA_HOME": str(xdg)}) == (
        tmp_path
    )
    assert default_data_dir({"XDG_DATA_HOME": str(xdg)}) == xdg / "kvgate"
    # A relative XDG_DATA_HOME is invalid per the XDG spec and is ignored.
    home = {"HOME": str(tmp_path), "XDG_DATA_HOME": "relative/dir"}
    assert default_data_dir(home) == tmp_path / ".local" / "share" / "kvgate"


def test_store_config_constructor_reads_data_dir_from_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_DATA_DIR", str(tmp_path))
    assert StoreConfig().tiers[1].url == f"file://{tmp_path}"
    assert [t.url for t in default_tiers()] == ["memory://", f"file://{tmp_path}"]
    assert Config is StoreConfig


# --- dict, file and environment ----------------------------------------------------------------


def test_mapping_is_validated() -> None:
    cfg = load_config(
        {
            "tiers": [
                {"url": "memory://", "capacity": "1GiB", "eviction": "S3FIFO"},
                {"url": "file:///var/lib/kvgate", "retry": {"attempts": 3}, "ttl": 60},
            ],
            "chunk_size": 128,
            "save_partial_chunks": True,
            "pin_memory": False,
        },
        env={},
    )
    assert cfg.tiers[0].eviction == "s3fifo"
    assert cfg.tiers[1].retry.attempts == 3
    assert cfg.tiers[1].ttl == 60.0
    assert (cfg.chunk_size, cfg.save_partial_chunks, cfg.pin_memory) == (128, True, False)


def test_mapping_without_tiers_gets_default_tiers(tmp_path: Path) -> None:
    cfg = load_config({"chunk_size": 64}, env={"KVGATE_DATA_DIR": str(tmp_path)})
    assert [t.url for t in cfg.tiers] == ["memory://", f"file://{tmp_path}"]
    assert cfg.chunk_size == 64


def test_the_default_disk_tier_uses_direct_io_unless_told_not_to(tmp_path: Path) -> None:
    env = {"KVGATE_DATA_DIR": str(tmp_path)}
    cfg = load_config({}, env=env)
    assert cfg.tiers[1].options == {"direct_io": True}
    assert cfg.pool_in_huge_pages()  # O_DIRECT reads into huge pages (StoreConfig docstring)
    off = load_config({}, env={**env, "KVGATE_TIERS__1__OPTIONS__DIRECT_IO": "false"})
    assert off.tiers[1].options == {"direct_io": "false"}  # the connector's options parse it
    assert not off.pool_in_huge_pages()


def test_store_config_source_is_final() -> None:
    given_cfg = StoreConfig(tiers=[TierConfig(url="memory://")])
    assert load_config(given_cfg, env={"KVGATE_CHUNK_SIZE": "9"}) is given_cfg


def test_yaml_file_by_str_and_pathlike(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "kvgate.yaml",
        {"tiers": [{"url": "memory://", "capacity": "512MiB"}], "chunk_size": 512},
    )
    for source in (path, str(path)):
        cfg = load_config(source, env={})
        assert cfg.tiers[0].capacity == 512 * MiB
        assert cfg.chunk_size == 512


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n", encoding="utf-8")
    cfg = load_config(path, env={"KVGATE_DATA_DIR": str(tmp_path)})
    assert len(cfg.tiers) == 2


def test_bad_paths_and_files(tmp_path: Path) -> None:
    assert "does not exist" in config_error(str(tmp_path / "missing.yaml"))
    assert "is not a file" in config_error(tmp_path)
    assert "must be a mapping" in config_error(write_yaml(tmp_path / "list.yaml", [1, 2]))
    assert "expected a path" in config_error("tiers:\n  - url: memory://\n")
    with pytest.raises(ConfigError, match="config source must be"):
        load_config(42, env={})  # type: ignore[arg-type]


def test_invalid_yaml_error_does_not_quote_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(f"tiers:\n  - url: redis://:{SECRET}@h:6379/0\n   bad: [\n", encoding="utf-8")
    msg = config_error(path)
    assert "not valid YAML at line" in msg
    assert SECRET not in msg


def test_kvgate_config_env_names_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", {"tiers": [{"url": "memory://"}], "chunk_size": 32})
    assert load_config(env={"KVGATE_CONFIG": str(path)}).chunk_size == 32
    # An explicit source wins over KVGATE_CONFIG.
    cfg = load_config({"tiers": [{"url": "memory://"}]}, env={"KVGATE_CONFIG": str(path)})
    assert cfg.chunk_size == 256
    assert "does not exist" in config_error(env={"KVGATE_CONFIG": str(tmp_path / "nope.yaml")})


def test_env_overrides_file(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "c.yaml",
        {
            "tiers": [{"url": "memory://"}, {"url": "file:///a", "timeout": 1.0}],
            "chunk_size": 128,
            "pin_memory": True,
        },
    )
    env = {
        "KVGATE_CHUNK_SIZE": "512",
        "KVGATE_SAVE_PARTIAL_CHUNKS": "true",
        "KVGATE_STAGING": "1GiB",
        "KVGATE_PREFETCH_DEADLINE": "2.5",
        "KVGATE_PIN_MEMORY": "none",
        "KVGATE_TIERS__1__TIMEOUT": "0.25",
        "KVGATE_TIERS__1__RETRY__ATTEMPTS": "4",
        "KVGATE_TIERS__1__OPTIONS__DB": "3",
        "KVGATE_TIERS__0__CODEC_OPTIONS": '{"level": 3}',
        "KVGATE_DATA_DIR": str(tmp_path),
        "UNRELATED": "x",
    }
    cfg = load_config(path, env=env)
    assert (cfg.chunk_size, cfg.save_partial_chunks, cfg.staging) == (512, True, GiB)
    assert (cfg.prefetch_deadline, cfg.pin_memory) == (2.5, None)
    assert cfg.tiers[1].timeout == 0.25
    assert cfg.tiers[1].retry.attempts == 4
    assert cfg.tiers[1].options == {"db": "3"}  # the connector types its own options
    assert cfg.tiers[0].codec_options == {"level": 3}


def test_write_policy_from_yaml_and_env(tmp_path: Path) -> None:
    assert load_config({"tiers": [{"url": "memory://"}]}, env={}).write_policy == "back"
    path = write_yaml(
        tmp_path / "c.yaml", {"tiers": [{"url": "memory://"}], "write_policy": "through"}
    )
    assert load_config(path, env={}).write_policy == "through"
    env = {"KVGATE_WRITE_POLICY": "Through"}
    assert load_config({"tiers": [{"url": "memory://"}]}, env=env).write_policy == "through"
    msg = config_error({"tiers": [{"url": "memory://"}], "write_policy": "around"})
    assert "write_policy" in msg
    assert "'back' or 'through'" in msg


def test_kvgate_tiers_replaces_then_nested_refines() -> None:
    env = {
        "KVGATE_TIERS": '[{"url": "memory://", "capacity": "1GiB"}, {"url": "blackhole://"}]',
        "KVGATE_TIERS__1__BACKPRESSURE": "skip",
    }
    cfg = load_config({"tiers": [{"url": "file:///x"}]}, env=env)
    assert [t.url for t in cfg.tiers] == ["memory://", "blackhole://"]
    assert cfg.tiers[1].backpressure == "skip"


def test_env_does_not_mutate_the_callers_mapping() -> None:
    source: dict[str, Any] = {"tiers": [{"url": "memory://", "retry": {"attempts": 2}}]}
    before = repr(source)
    cfg = load_config(source, env={"KVGATE_TIERS__0__RETRY__ATTEMPTS": "5"})
    assert cfg.tiers[0].retry.attempts == 5
    assert repr(source) == before


def test_env_override_reaches_into_tier_objects_in_a_mapping() -> None:
    source = {"tiers": [TierConfig(url="memory://"), TierConfig(url="file:///x")]}
    cfg = load_config(source, env={"KVGATE_TIERS__1__WORKERS": "8"})
    assert cfg.tiers[1].workers == 8
    assert source["tiers"][1].workers == 4


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"KVGATE_CHUNKSIZE": "1"}, "KVGATE_CHUNKSIZE: unknown kvgate environment variable"),
        ({"KVGATE_TIERS__5__TIMEOUT": "1"}, "KVGATE_TIERS__5__TIMEOUT: '5' is not a position"),
        ({"KVGATE_TIERS__X__TIMEOUT": "1"}, "KVGATE_TIERS__X__TIMEOUT: 'x' is not a position"),
        ({"KVGATE_TIERS": "[{"}, "KVGATE_TIERS: invalid JSON"),
        ({"KVGATE_TIERS": '{"url": "memory://"}'}, "(from KVGATE_TIERS)"),
        ({"KVGATE_TIERS__0__TIMEOT": "1"}, "tiers.0.timeot: unknown key (did you mean"),
        ({"KVGATE_TIERS__0__TIMEOT": "1"}, "(from KVGATE_TIERS__0__TIMEOT)"),
        ({"KVGATE_TIERS__0__TIMEOUT": "-1"}, "tiers.0.timeout: Input should be greater than 0"),
        ({"KVGATE_CHUNK_SIZE__X": "1"}, "(from KVGATE_CHUNK_SIZE__X)"),
        ({"KVGATE_TIERS__0__URL__X": "1"}, "tiers.0.url has no nested keys"),
        ({"KVGATE_TIERS____X": "1"}, "empty name segment"),
        ({"KVGATE_PIN_MEMORY": "maybe"}, "pin_memory: Input should be a valid boolean"),
    ],
)
def test_env_errors_name_the_variable(env: dict[str, str], expected: str) -> None:
    assert expected in config_error({"tiers": [{"url": "memory://"}]}, env=env)


# --- strict keys and invalid values -------------------------------------------------------------


def test_unknown_keys_are_rejected_with_their_location(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "typo.yaml",
        {
            "tiers": [
                {"url": "memory://"},
                {"url": "file:///x", "capacty": "1GiB", "retry": {"attemps": 3}},
            ],
            "chunk_sise": 64,
        },
    )
    msg = config_error(path)
    assert str(path) in msg
    assert "tiers.1.capacty: unknown key (did you mean 'capacity'?)" in msg
    assert "tiers.1.retry.attemps: unknown key (did you mean 'attempts'?)" in msg
    assert "chunk_sise: unknown key (did you mean 'chunk_size'?)" in msg


def test_config_error_is_a_gateway_error() -> None:
    with pytest.raises(GatewayError) as info:
        load_config({"bogus": 1}, env={})
    assert isinstance(info.value, ConfigError)
    assert info.value.kind == "config"
    assert info.value.__cause__ is None  # the ValidationError (with inputs) is not chained
    assert "bogus: unknown key" in str(info.value)


@pytest.mark.parametrize(
    ("tier", "expected"),
    [
        ({"eviction": "random"}, "tiers.0.eviction: unknown eviction policy 'random'"),
        ({"backpressure": "drop"}, "tiers.0.backpressure: Input should be 'wait' or 'skip'"),
        ({"timeout": -1}, "tiers.0.timeout: Input should be greater than 0"),
        ({"timeout": 0}, "tiers.0.timeout: Input should be greater than 0"),
        ({"timeout": float("nan")}, "tiers.0.timeout:"),
        ({"ttl": 0}, "tiers.0.ttl: Input should be greater than 0"),
        ({"concurrency": 0}, "tiers.0.concurrency:"),
        ({"queue_size": 0}, "tiers.0.queue_size:"),
        ({"workers": 0}, "tiers.0.workers:"),
        ({"retry": {"attempts": 0}}, "tiers.0.retry.attempts:"),
        ({"retry": {"backoff_base": 1, "backoff_max": 0.5}}, "backoff_max must not be smaller"),
        ({"breaker": {"failures": -1}}, "tiers.0.breaker.failures:"),
        ({"codec": ""}, "tiers.0.codec:"),
        ({"url": "/var/lib/kvgate"}, "tiers.0.url: expected a URL with a scheme"),
        ({"url": None}, "tiers.0.url:"),
    ],
)
def test_invalid_tier_values(tier: dict[str, Any], expected: str) -> None:
    assert expected in config_error({"tiers": [{"url": "memory://", **tier}]})


def test_store_level_errors() -> None:
    assert "required key missing" in config_error({"tiers": [{"capacity": 1}]})
    assert "tiers: List should have at least 1 item" in config_error({"tiers": []})
    assert "chunk_size:" in config_error({"tiers": [{"url": "memory://"}], "chunk_size": 0})
    dup = {"tiers": [{"url": "memory://", "name": "a"}, {"url": "file:///x", "name": "a"}]}
    assert "tier name 'a' is used twice" in config_error(dup)


def test_case_insensitive_choices() -> None:
    tier = TierConfig.model_validate(
        {"url": "memory://", "eviction": " LFU ", "backpressure": "SKIP"}
    )
    assert (tier.eviction, tier.backpressure) == ("lfu", "skip")


# --- LMCache compatibility ------------------------------------------------------------------------

LMCACHE_YAML = """\
# LMCache engine config, as in LMCache's examples
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5.0
local_disk: "file://local_disk/"
max_local_disk_size: 20
remote_url: "lm://localhost:65432"
remote_serde: "cachegen"
cache_policy: "LFU"
save_unfull_chunk: True
blocking_timeout_secs: 30
use_layerwise: False
enable_p2p: False
pre_caching_hash_algorithm: sha256_cbor_64bit
extra_config:
  remote_enable_mla_worker_id_as0: false
"""


def test_lmcache_yaml_is_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)  # "file://local_disk/" is a path relative to the cwd
    path = tmp_path / "lmcache.yaml"
    path.write_text(LMCACHE_YAML, encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="gateway.config"):
        cfg = load_config(path, env={})
    mem, disk, remote = cfg.tiers
    assert (mem.url, mem.capacity, mem.eviction) == ("memory://", 5 * GiB, "lfu")
    assert (disk.url, disk.capacity, disk.eviction) == (
        f"file://{tmp_path / 'local_disk'}",
        20 * GiB,
        "lfu",
    )
    assert (remote.url, remote.codec, remote.timeout) == ("lm://localhost:65432", "cachegen", 30)
    assert (cfg.chunk_size, cfg.save_partial_chunks) == (256, True)
    warning = " ".join(r.getMessage() for r in caplog.records)
    for ignored in ("enable_p2p", "extra_config", "pre_caching_hash_algorithm", "use_layerwise"):
        assert ignored in warning


@pytest.mark.parametrize(
    ("lm", "urls"),
    [
        ({"local_cpu": False, "remote_url": "redis://h:6379"}, ["redis://h:6379"]),
        ({"local_disk": "/mnt/kv", "max_local_disk_size": 1}, ["memory://", "file:///mnt/kv"]),
        (
            {"local_disk": "file:///mnt/kv/", "max_local_disk_size": 1},
            ["memory://", "file:///mnt/kv"],
        ),
        # LMCache creates no disk backend when its size is 0 (its default).
        ({"local_disk": "file:///mnt/kv/"}, ["memory://"]),
    ],
)
def test_lmcache_tier_shapes(lm: dict[str, Any], urls: list[str]) -> None:
    assert [t["url"] for t in map_lmcache_config(lm)["tiers"]] == urls


def test_lmcache_defaults_and_serde() -> None:
    mapped = map_lmcache_config({"remote_url": "lm://h:1", "remote_serde": "naive"})
    mem, remote = mapped["tiers"]
    assert mem == {"url": "memory://", "capacity": 5 * GiB, "eviction": "LRU"}
    assert remote == {"url": "lm://h:1", "codec": "raw", "timeout": 10.0}
    kivi = map_lmcache_config({"remote_url": "lm://h:1", "remote_serde": "KIVI"})
    assert kivi["tiers"][1]["codec"] == "kivi"


@pytest.mark.parametrize(
    ("lm", "expected"),
    [
        ({"remote_url": "lm://h:1", "remote_serde": "pickle"}, "unknown serde 'pickle'"),
        ({"cache_policy": "random"}, "unknown eviction policy 'random'"),
        ({"cache_policy": "random"}, "(from LMCache key cache_policy)"),
        ({"local_cpu": False}, "enables no storage"),
        ({"local_cpu": "sometimes"}, "local_cpu: expected true or false"),
        ({"max_local_cpu_size": -1}, "max_local_cpu_size: must be a non-negative"),
        ({"local_disk": "/a,/b", "max_local_disk_size": 1}, "comma-separated"),
        ({"local_cpu": True, "tiers": []}, "mixes kvgate keys (tiers) with LMCache keys"),
        ({"local_cpu": True, "chunk_size": 0}, "chunk_size:"),
    ],
)
def test_lmcache_errors(lm: dict[str, Any], expected: str) -> None:
    assert expected in config_error(lm)


def test_chunk_size_alone_is_a_kvgate_config(tmp_path: Path) -> None:
    cfg = load_config({"chunk_size": 128}, env={"KVGATE_DATA_DIR": str(tmp_path)})
    assert [t.url for t in cfg.tiers] == ["memory://", f"file://{tmp_path}"]


def test_kvgate_env_applies_on_top_of_lmcache_config() -> None:
    cfg = load_config(
        {"local_cpu": True, "max_local_cpu_size": 1}, env={"KVGATE_TIERS__0__CAPACITY": "2GiB"}
    )
    assert cfg.tiers[0].capacity == 2 * GiB


def test_load_lmcache_env(tmp_path: Path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(LMCACHE_YAML, encoding="utf-8")
    env = {
        "LMCACHE_CONFIG_FILE": str(path),
        "LMCACHE_CHUNK_SIZE": "128",
        "LMCACHE_LOCAL_CPU": "false",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2.5",
        "LMCACHE_REMOTE_URL": "redis://h:6379/1",
        "LMCACHE_USE_LAYERWISE": "true",
        "LMCACHE_LOOKUP_TIMEOUT_MS": "3000",
        "LMCACHE_DISABLE_BANNER": "1",
    }
    data = load_lmcache_env(env)
    assert data["chunk_size"] == 128
    assert data["local_cpu"] is False
    assert data["max_local_cpu_size"] == 2.5
    assert data["remote_url"] == "redis://h:6379/1"
    assert data["use_layerwise"] is True
    assert data["lookup_timeout_ms"] == 3000
    assert data["cache_policy"] == "LFU"  # from the file, not overridden
    assert "disable_banner" not in data
    assert "config_file" not in data


def test_load_config_uses_lmcache_env_only_without_kvgate_sources(tmp_path: Path) -> None:
    env = {
        "LMCACHE_CHUNK_SIZE": "128",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
        "LMCACHE_REMOTE_URL": "lm://h:65432",
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_BLOCKING_TIMEOUT_SECS": "3",
        "LMCACHE_SAVE_UNFULL_CHUNK": "true",
    }
    cfg = load_config(env=env)
    assert [t.url for t in cfg.tiers] == ["memory://", "lm://h:65432"]
    assert cfg.tiers[0].capacity == GiB
    assert (cfg.tiers[1].codec, cfg.tiers[1].timeout) == ("raw", 3.0)
    assert (cfg.chunk_size, cfg.save_partial_chunks) == (128, True)

    kvgate_file = write_yaml(tmp_path / "k.yaml", {"tiers": [{"url": "memory://"}]})
    assert len(load_config(env={**env, "KVGATE_CONFIG": str(kvgate_file)}).tiers) == 1
    assert load_config({"tiers": [{"url": "memory://"}]}, env=env).chunk_size == 256
    # Process-level LMCache variables say nothing about storage: kvgate's defaults apply.
    plain = load_config(env={"LMCACHE_DISABLE_BANNER": "1", "KVGATE_DATA_DIR": str(tmp_path)})
    assert [t.capacity for t in plain.tiers] == [2 * GiB, 20 * GiB]
    # From LMCache's environment, chunk_size alone still means LMCache's defaults.
    only_chunk = load_config(env={"LMCACHE_CHUNK_SIZE": "64"})
    assert [(t.url, t.capacity) for t in only_chunk.tiers] == [("memory://", 5 * GiB)]


def test_lmcache_env_bad_number_names_the_variable() -> None:
    assert "LMCACHE_CHUNK_SIZE: expected a number" in config_error(
        env={"LMCACHE_CHUNK_SIZE": "lots"}
    )


# --- secrets ----------------------------------------------------------------------------------


def secret_config() -> StoreConfig:
    return load_config(
        {
            "tiers": [
                {"url": "memory://"},
                {
                    "url": f"redis://:{SECRET}@cache.internal:6379/0",
                    "options": {
                        "password": SECRET,
                        "aws_secret_access_key": SECRET,
                        "nested": {"api_key": SECRET, "urls": [f"redis://u:{SECRET}@h"]},
                        "recent_tokens": 128,
                        "db": 0,
                    },
                    "codec_options": {"token": SECRET},
                },
            ]
        },
        env={},
    )


def test_secrets_redacted_in_repr_str_and_dumps() -> None:
    cfg = secret_config()
    tier = cfg.tiers[1]
    shown = [repr(tier), str(tier), f"{tier}", repr(cfg), str(cfg), dump_config(cfg)]
    shown += [cfg.model_dump_yaml(), repr(tier.redacted()), repr(cfg.redacted())]
    for text in shown:
        assert SECRET not in text
        assert "***" in text
    assert "cache.internal:6379/0" in repr(tier)
    assert "'recent_tokens': 128" in repr(tier)  # a count of tokens is not a secret
    dumped = yaml.safe_load(dump_config(cfg))
    assert dumped["tiers"][1]["url"] == "redis://:***@cache.internal:6379/0"
    assert dumped["tiers"][1]["options"]["nested"] == {
        "api_key": "***",
        "urls": ["redis://u:***@h"],
    }
    # Code still sees the real values.
    assert tier.url == f"redis://:{SECRET}@cache.internal:6379/0"
    assert tier.options["password"] == SECRET
    assert tier.codec_options["token"] == SECRET
    assert tier.model_dump()["options"]["password"] == SECRET


def test_secrets_redacted_in_log_records(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kvgate.test")
    with caplog.at_level(logging.DEBUG):
        cfg = secret_config()  # load_config logs the effective config at debug level
        log.info("tier %s", cfg.tiers[1])
        log.info("config %r", cfg)
    messages = [r.getMessage() for r in caplog.records]
    assert any("kvgate config from" in m for m in messages)
    assert any(m.startswith("tier ") for m in messages)
    assert all(SECRET not in m for m in messages)
    assert cfg.tiers[1].options["password"] == SECRET


def test_secrets_stay_out_of_errors(tmp_path: Path) -> None:
    bad = {"tiers": [{"url": f"redis://:{SECRET}@h", "timeout": -1, "options": {"pw": SECRET}}]}
    assert SECRET not in config_error(bad)
    with pytest.raises(ValidationError) as info:
        TierConfig(url=f"redis://:{SECRET}@h", timeout=-1)
    assert SECRET not in str(info.value)
    env_msg = config_error(env={"KVGATE_TIERS": f'[{{"url": "redis://:{SECRET}@h"'})
    assert SECRET not in env_msg


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("memory://", "memory://"),
        ("file:///var/lib/kvgate", "file:///var/lib/kvgate"),
        ("lm://localhost:65432", "lm://localhost:65432"),
        ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:secret@host", "redis://user:***@host"),
        ("rediss://user:p%40ss@host:6380/1?db=2", "rediss://user:***@host:6380/1?db=2"),
        ("redis://justatoken@host", "redis://***@host"),
        (
            "s3://bucket/p?access_key=AK&secret_key=SK&region=eu",
            "s3://bucket/p?access_key=***&secret_key=***&region=eu",
        ),
        ("http://h/x?token=abc#frag", "http://h/x?token=***#frag"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("password", True),
        ("redis_password", True),
        ("passwd", True),
        ("secret_key", True),
        ("aws_secret_access_key", True),
        ("access_key", True),
        ("accessKey", True),
        ("api_key", True),
        ("apikey", True),
        ("auth_token", True),
        ("token", True),
        ("credentials_file", True),
        ("recent_tokens", False),
        ("db", False),
        ("username", False),
        ("max_connections", False),
    ],
)
def test_is_secret_key(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


def test_os_environ_is_the_default_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith(("KVGATE_", "LMCACHE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVGATE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("KVGATE_CHUNK_SIZE", "64")
    cfg = load_config()
    assert cfg.chunk_size == 64
    assert cfg.tiers[1].url == f"file://{tmp_path}"
