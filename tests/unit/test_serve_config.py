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
    with pytest.warns(FutureWarning, match="scheduling_policy 'static' is deprecated"):  # its former meaning
        cfg = build_config(yaml_path, {}, {})
    assert cfg.replicas == "auto" and (cfg.engine.batching_policy, cfg.engine.scheduling_policy) == ("static", "fcfs")
    yaml_path.write_text("engine:\n  scheduling_policy: priority\n  batching_policy: static\n")
    cfg = build_config(yaml_path, {}, {})
    assert (cfg.engine.batching_policy, cfg.engine.scheduling_policy) == ("static", "priority")
    # Each source's former names are moved before the command line overrides the file: the file's
    # static batching survives a --scheduling-policy priority, and a command line's former name
    # overrides the file's batching policy instead of contradicting it.
    yaml_path.write_text("engine:\n  scheduling_policy: static\n")
    with pytest.warns(FutureWarning):
        cfg = build_config(yaml_path, {}, {"scheduling_policy": "priority"})
    assert (cfg.engine.batching_policy, cfg.engine.scheduling_policy) == ("static", "priority")
    yaml_path.write_text("engine:\n  batching_policy: static\n")
    with pytest.warns(FutureWarning):
        cfg = build_config(yaml_path, {}, {"scheduling_policy": "continuous"})
    assert (cfg.engine.batching_policy, cfg.engine.scheduling_policy) == ("continuous", "fcfs")


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

    # The shipped Serve config is for `serve run`; carpool serve says so instead of listing fields.
    from pathlib import Path

    serve_config = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"
    with pytest.raises(ValueError, match="serve run"):
        build_config(serve_config, {}, {})


# ---- replica placement and scaling (cluster/app.py), through the options build_app gives Serve --
def _replica_deployment(app):
    """The LLMReplica deployment inside the application build_app returns (ingress → replica)."""
    return app._bound_deployment.init_args[0]._bound_deployment


def test_auto_replicas_one_per_core_without_gpus_and_one_per_gpu_on_cuda():
    from cluster.app import replicas_for_resources

    cpu = ServeConfig()
    assert cpu.replicas == "auto"
    assert replicas_for_resources(cpu, {"CPU": 8.0, "memory": 1e10}) == 8
    assert replicas_for_resources(cpu, {"CPU": 1.5}) == 1
    assert replicas_for_resources(ServeConfig(num_cpus_per_replica=2), {"CPU": 8.0}) == 4
    assert replicas_for_resources(ServeConfig(replicas=3), {"CPU": 8.0}) == 3
    cuda = ServeConfig(engine={"device": "cuda"})
    assert replicas_for_resources(cuda, {"CPU": 64.0, "GPU": 4.0}) == 4
    with pytest.raises(ValueError, match="no GPU"):
        replicas_for_resources(cuda, {"CPU": 64.0})


def test_build_app_asks_one_gpu_per_replica_on_cuda():
    from cluster.app import build_app

    replica = _replica_deployment(build_app(ServeConfig(engine={"device": "cuda", "dtype": "bfloat16"}), 4))
    assert replica.name == "LLMReplica"
    assert replica.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1}
    assert replica.num_replicas == 4
    assert replica.max_ongoing_requests == 1024
    assert replica._deployment_config.autoscaling_config is None

    on_cpu = _replica_deployment(build_app(ServeConfig(num_cpus_per_replica=2), 2))
    assert on_cpu.ray_actor_options == {"num_cpus": 2.0}  # no GPU asked for
    assert on_cpu.init_args[1] == 2  # torch threads = reserved cores


def test_autoscaling_becomes_the_replica_autoscaling_config():
    from cluster.app import build_app, replica_deployment_options

    config = ServeConfig(
        engine={"device": "cuda"},
        autoscaling={
            "policy": "ongoing_requests", "min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 24,
            "upscale_delay_s": 5,
        },
    )
    options = replica_deployment_options(config, None)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 24, "upscale_delay_s": 5,
        "look_back_period_s": 30.0, "metrics_interval_s": 2.0,
    }
    assert options["graceful_shutdown_timeout_s"] == 300.0  # a replica scaled down finishes its requests
    scaling = _replica_deployment(build_app(config))._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests, scaling.upscale_delay_s) == (1, 8, 24, 5)
    with pytest.raises(ValueError, match="autoscaling"):
        replica_deployment_options(config, 2)


def test_autoscaling_settings_are_validated():
    with pytest.raises(ValidationError, match="not both"):
        ServeConfig(replicas=2, autoscaling={"max_replicas": 4})
    with pytest.raises(ValidationError, match="min_replicas"):  # Serve's own check
        ServeConfig(autoscaling={"min_replicas": 5, "max_replicas": 4})
    with pytest.raises(ValidationError) as info:
        ServeConfig(autoscaling={"max_replicas": 4, "target_requests": 3})
    assert "  autoscaling.target_requests: " in format_validation_error(info.value)
    # The ingress receives the config as a dict and validates it again.
    config = ServeConfig(autoscaling={"max_replicas": 4})
    assert ServeConfig(**config.model_dump()) == config


def test_app_builder_takes_serve_config_fields(tmp_path):
    from cluster.app import app_builder

    # Without replicas or autoscaling in args, the code default is one replica (the Serve config's
    # deployments entry sets the count); nothing needs a Ray cluster here.
    replica = _replica_deployment(app_builder({"engine": {"device": "cuda", "max_num_seqs": 8}}))
    assert replica.num_replicas == 1 and replica.ray_actor_options["num_gpus"] == 1
    assert replica.init_args[0]["max_num_seqs"] == 8
    replica = _replica_deployment(app_builder({"replicas": 3}))
    assert replica.num_replicas == 3
    replica = _replica_deployment(app_builder({"autoscaling": {"min_replicas": 2, "max_replicas": 3}}))
    assert replica._deployment_config.autoscaling_config.min_replicas == 2
    with pytest.raises(ValidationError):
        app_builder({"engine": {"seats": 4}})
    # carpool serve --config reads the same field.
    path = tmp_path / "c.yaml"
    path.write_text("autoscaling:\n  min_replicas: 1\n  max_replicas: 2\n")
    assert build_config(path, {}, {}).autoscaling.max_replicas == 2
def test_limits_defaults_and_bounds():
    cfg = ServeConfig()
    assert cfg.host == "127.0.0.1"  # loopback unless told otherwise
    assert cfg.api_key is None
    assert (cfg.max_waiting_requests, cfg.max_n, cfg.max_logprobs) == (256, 16, 20)
    assert cfg.max_request_body_bytes == 8 * 2**20
    # Serve's max_ongoing_requests must sit above what a replica admits, so the replica refuses the rest.
    assert cfg.max_ongoing_requests == 1024
    with pytest.raises(ValidationError, match="max_ongoing_requests"):
        ServeConfig(max_ongoing_requests=288)  # 32 seats + 256 waiting: Serve would queue the rest
    with pytest.raises(ValidationError, match="max_ongoing_requests"):
        ServeConfig(engine={"max_num_seqs": 1000})
    assert ServeConfig(engine={"max_num_seqs": 1000}, max_ongoing_requests=2000).max_ongoing_requests == 2000


def test_replica_deployment_bounds_its_handle_queue():
    from cluster.app import replica_deployment_options

    options = replica_deployment_options(ServeConfig(engine={"max_num_seqs": 4}, max_waiting_requests=6), 3)
    assert options["max_queued_requests"] == 3 * (4 + 6) + 64
    assert options["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}
    scaled = ServeConfig(engine={"max_num_seqs": 4}, max_waiting_requests=6, autoscaling={"max_replicas": 5})
    assert replica_deployment_options(scaled, None)["max_queued_requests"] == 5 * (4 + 6) + 64
    with pytest.raises(ValidationError) as info:
        ServeConfig(max_logprobs=21, max_n=0, max_waiting_requests=-1, max_request_body_bytes=10, api_key="")
    text = format_validation_error(info.value)
    for name in ("max_logprobs", "max_n", "max_waiting_requests", "max_request_body_bytes", "api_key"):
        assert f"  {name}: " in text, text


def test_serve_command_line_limits_reach_the_config(tmp_path):
    from typer.testing import CliRunner

    from cluster.cli import app

    # A bad value stops `carpool serve` before anything starts, named by its field.
    result = CliRunner().invoke(app, ["serve", "--max-n", "0", "--max-waiting-requests", "-1", "--max-logprobs", "30"])
    assert result.exit_code == 2
    for name in ("max_n", "max_waiting_requests", "max_logprobs"):
        assert f"  {name}: " in result.output, result.output
    result = CliRunner().invoke(app, ["serve", "--max-request-body-bytes", "lots"])
    assert result.exit_code == 2 and "max_request_body_bytes" in result.output
    result = CliRunner().invoke(app, ["serve", "--seats", "8", "--max-waiting-requests", "8", "--max-ongoing-requests", "16"])
    assert result.exit_code == 2 and "max_ongoing_requests (16) must be greater" in result.output
    cfg = build_config(None, {"max_request_body_bytes": parse_bytes("1MiB"), "max_stop_sequences": 2}, {})
    assert (cfg.max_request_body_bytes, cfg.max_stop_sequences) == (2**20, 2)


def test_speculative_config_reaches_the_engine_config_or_is_refused_by_key(tmp_path, monkeypatch):
    """``--speculative-config '<JSON>'`` (vLLM's flag) and ``engine: {speculative_config: ...}`` in a
    config file; a bad JSON or key stops ``carpool serve`` before anything starts, named."""
    from typer.testing import CliRunner

    import cluster.app
    import cluster.cli
    from cluster.cli import app

    started = []
    monkeypatch.setattr(cluster.cli, "serve_forever", started.append)
    monkeypatch.setattr(cluster.app, "listen_problem", lambda host, port: None)
    result = CliRunner().invoke(app, ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'])
    assert result.exit_code == 0, result.output
    spec = started[0].engine.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 2, 3)
    assert started[0].engine.model_dump()["speculative_config"]["num_speculative_tokens"] == 4  # what replicas get

    path = tmp_path / "spec.yaml"
    path.write_text("engine:\n  speculative_config:\n    method: draft_model\n    model: some/draft\n    num_speculative_tokens: 2\n")
    assert build_config(path, {}, {}).engine.speculative_config.model == "some/draft"
    cfg = build_config(path, {}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5}})
    assert cfg.engine.speculative_config.method == "ngram"  # the option replaces the file's
    assert ServeConfig().engine.speculative_config is None

    for bad, named in [
        ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 1}', "  engine.speculative_config.lookahead: Extra inputs are not permitted"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "  engine.speculative_config.num_speculative_tokens: Input should be greater than or equal to 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}', "  engine.speculative_config: prompt_lookup_min (6) is above prompt_lookup_max (5)"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "engine.speculative_config: model: method draft_model needs"),
        ("{'method': 'ngram'}", "--speculative-config is not valid JSON"),
        ("[4]", "--speculative-config must be a JSON object"),
    ]:
        result = CliRunner().invoke(app, ["serve", "--speculative-config", bad])
        assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output, result.output
    path.write_text("engine:\n  speculative_config:\n    method: ngram\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(path)])
    assert result.exit_code == 2 and "  engine.speculative_config.num_speculative_tokens: Field required" in result.output
    assert len(started) == 1


@pytest.mark.parametrize("key", ["sk-tést", " sk", "sk ", "s k", "sk\n"])
def test_api_keys_that_no_header_could_carry_are_refused(key):
    with pytest.raises(ValidationError, match="printable ASCII"):
        ServeConfig(api_key=key)
    assert ServeConfig(api_key="sk-ok_123").api_key == "sk-ok_123"


@pytest.mark.parametrize(
    "argv", [["serve", "--help"], ["bench", "serve", "--help"], ["bench", "offline", "--help"], ["bench", "profile", "--help"]]
)
def test_help_shows_every_option_whole_at_80_columns(argv):
    """``--help`` on an 80-column terminal names every option in full and cuts no default short."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from cluster.cli import app

    result = CliRunner().invoke(app, argv, env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    command = get_command(app)
    for name in argv[:-1]:
        command = command.commands[name]
    names = [opt for p in command.params if p.param_type_name == "option" for opt in p.opts]
    assert len(names) > 5
    words = set(result.output.replace(",", " ").replace("/", " ").split())
    missing = [n for n in names if n not in words]
    assert not missing, f"options cut or missing from --help: {missing}\n{result.output}"
    assert "…" not in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_lora_settings_reach_the_config_and_turn_lora_on(tmp_path, monkeypatch):
    """``--lora-modules a=PATH b=PATH`` (vLLM's spelling; the option repeated works too),
    ``--lora-dir``, the engine's LoRA flags; adapters turn ``enable_lora`` on unless it is off on
    purpose; bad modules stop ``carpool serve`` before anything starts, named."""
    from typer.testing import CliRunner

    import cluster.app
    import cluster.cli
    from cluster.cli import app

    started = []
    monkeypatch.setattr(cluster.cli, "serve_forever", started.append)
    monkeypatch.setattr(cluster.app, "listen_problem", lambda host, port: None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loras").mkdir()
    argv = ["serve", "--lora-modules", "sql=adapters/sql", "chat=/abs/chat", "--lora-dir", "loras", "--max-loras", "2",
            "--max-lora-rank", "32", "--max-cpu-loras", "6", "--no-lora-aware-routing"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    cfg = started[-1]
    assert cfg.lora_modules == {"sql": str(tmp_path / "adapters/sql"), "chat": "/abs/chat"}
    assert cfg.lora_dirs == [str(tmp_path / "loras")] and not cfg.lora_aware_routing
    assert (cfg.engine.enable_lora, cfg.engine.max_loras, cfg.engine.max_lora_rank, cfg.engine.max_cpu_loras) == (True, 2, 32, 6)
    result = CliRunner().invoke(app, ["serve", "--lora-modules", "a=/x", "--lora-modules", '{"name": "b", "path": "/y"}'])
    assert result.exit_code == 0 and started[-1].lora_modules == {"a": "/x", "b": "/y"}, result.output
    assert not ServeConfig().engine.enable_lora and ServeConfig(lora_dirs=["/d"]).engine.enable_lora

    for bad, named in [
        (["--lora-modules", "sql"], "--lora-modules: a LoRA module is name=path, got 'sql'"),
        (["--lora-modules", "a=/x", "a=/y"], "--lora-modules: adapter 'a' is given twice"),
        (["stray=/x"], "unexpected arguments 'stray=/x'"),
        (["--lora-modules", "a=/x", "--no-enable-lora"], "lora_modules needs LoRA, but engine.enable_lora is false"),
        (["--served-model-name", "m", "--lora-modules", "m=/x"], "adapter name 'm' is the served model's name"),
        (["--lora-dir", str(tmp_path / "missing")], "does not exist"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras (2) must be at least max_loras (4)"),
    ]:
        result = CliRunner().invoke(app, ["serve", *bad])
        assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output, (bad, result.output)

    path = tmp_path / "lora.yaml"
    path.write_text("lora_modules:\n  - sql=/adapters/sql\nlora_dirs: [/adapters]\nengine:\n  max_loras: 3\n")
    cfg = build_config(path, {}, {})
    assert cfg.lora_modules == {"sql": "/adapters/sql"} and cfg.engine.enable_lora and cfg.engine.max_loras == 3
    assert build_config(path, {"lora_modules": {"x": "/x"}}, {}).lora_modules == {"x": "/x"}  # the option replaces the file's


def test_a_config_file_with_names_that_are_not_strings_and_a_host_that_is_not_one_are_named(tmp_path):
    """YAML keys such as ``1:`` or ``null:`` are refused by the file's name (not a TypeError from
    the settings model); a host idna cannot encode (an empty label) is a host problem, not a crash."""
    from cluster.cli import load_config_file
    from cluster.preflight import listen_problem

    path = tmp_path / "c.yaml"
    for text in ("1: 2\n", "null: 3\nport: 8000\n"):
        path.write_text(text)
        with pytest.raises(ValueError, match="setting names must be strings"):
            load_config_file(path)
    for host in ("a..b", "x" * 64 + ".example"):
        assert listen_problem(host, 8000).startswith(f"host: {host!r} cannot be resolved")
