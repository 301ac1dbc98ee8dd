"""``carpool serve`` settings without Ray: precedence, sizes, errors by field name."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cluster.cli import build_config, format_validation_error, parse_bytes
from cluster.config import ServeConfig


def test_parse_bytes():
    assert parse_bytes("1073741824") == 2**30
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_file_then_command_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"port": 9000, "replicas": 3, "engine": {"dtype": "float32", "max_num_seqs": 4}}))
    cfg = build_config(path, {"port": 9100, "replicas": None}, {"max_num_seqs": 8, "model": None})
    assert (cfg.port, cfg.replicas) == (9100, 3)
    assert (cfg.engine.dtype, cfg.engine.max_num_seqs) == ("float32", 8)
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("replicas: auto\nengine:\n  scheduling_policy: static\n")
    cfg = build_config(yaml_path, {}, {})
    assert cfg.replicas == "auto" and cfg.engine.scheduling_policy == "static"


def test_errors_name_the_field():
    with pytest.raises(ValidationError) as info:
        ServeConfig(replicas="two", port=0, engine={"max_num_seqs": 0}, bogus=1)
    text = format_validation_error(info.value)
    for field in ("replicas", "port", "engine.max_num_seqs", "bogus"):
        assert f"  {field}: " in text, text
    assert ServeConfig(replicas="2").replicas == 2
    assert ServeConfig().model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ServeConfig(served_model_name="smol").model_name == "smol"


def test_bad_file(tmp_path):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        build_config(tmp_path / "list.yaml", {}, {})
    with pytest.raises(ValueError, match="cannot read"):
        build_config(tmp_path / "absent.json", {}, {})
