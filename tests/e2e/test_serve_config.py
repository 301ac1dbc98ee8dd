"""``deploy/serve_config.yaml`` deployed for real, through Serve's config API, on the session's cluster.

The config goes through ``ServeDeploySchema`` to the controller's ``apply_config`` (what
``serve run deploy/serve_config.yaml`` does; ``serve deploy`` reaches the same controller method
through the dashboard), so Serve imports ``cluster.app:app_builder``, builds the app from ``args``
and applies the ``deployments`` overrides. The overrides for this 2-CPU test cluster, and nothing
else, are :func:`cpu_overrides`.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import Served

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"
APP = "e2e-serve-config"
DEPLOY_TIMEOUT_S = 180


def cpu_overrides(config: dict) -> dict:
    """The shipped config with the documented test overrides: app name (unique in the session),
    CPU device, small seats and KV pool, and no GPU in the replica's actor options."""
    config = copy.deepcopy(config)
    (app,) = config["applications"]
    app["name"] = APP
    app["args"]["engine"].update(device="cpu", max_num_seqs=4, num_blocks=64, max_model_len=512, compile=False)
    (replica,) = [d for d in app["deployments"] if d["name"] == "LLMReplica"]
    replica["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 0}
    return config


@pytest.fixture(scope="module")
def shipped() -> dict:
    return yaml.safe_load(SERVE_CONFIG.read_text())


@pytest.fixture(scope="module")
def served(ray_cluster, shipped):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ServeConfig

    config = cpu_overrides(shipped)
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    try:
        deadline = time.monotonic() + DEPLOY_TIMEOUT_S
        while True:
            status = serve.status().applications.get(APP)
            if status is not None and status.status == "RUNNING":
                break
            assert status is None or status.status != "DEPLOY_FAILED", status.message
            assert time.monotonic() < deadline, f"{APP} not running after {DEPLOY_TIMEOUT_S}s: {status}"
            time.sleep(0.5)
        yield Served(APP, ray_cluster, ServeConfig.model_validate(config["applications"][0]["args"]))
    finally:
        serve.delete(APP)


def test_config_deployed_app_answers_a_chat_request(served):
    reply = served.client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    answer = reply.choices[0].message.content
    print(f"\nconfig-deployed app answered: {answer!r}")
    assert "Paris" in answer
    assert reply.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert httpx.get(served.root_url + "/health", timeout=10).status_code == 200


def test_config_overrides_reach_the_deployments(served, shipped):
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()["applications"][APP]
    assert details["deployed_app_config"]["import_path"] == "cluster.app:app_builder"
    replica = details["deployments"]["LLMReplica"]
    config = replica["deployment_config"]
    assert config["ray_actor_options"]["num_cpus"] == 1 and config["ray_actor_options"]["num_gpus"] == 0
    expected = [d for d in shipped["applications"][0]["deployments"] if d["name"] == "LLMReplica"][0]
    assert config["max_ongoing_requests"] == expected["max_ongoing_requests"]
    # args.autoscaling became the deployment's autoscaling_config: the Carpool policy, its bounds.
    wanted = shipped["applications"][0]["args"]["autoscaling"]
    scaling = config["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (wanted["min_replicas"], wanted["max_replicas"])
    assert scaling["policy"]["policy_function"] == "cluster.autoscaling.policy:CarpoolAutoscalingPolicy"
    assert scaling["policy"]["policy_kwargs"]["downscale_delay_s"] == wanted["downscale_delay_s"]
    # Autoscaled from min_replicas; with no load it stays there.
    running = [r for r in replica["replicas"] if r["state"] == "RUNNING"]
    assert len(running) == wanted["min_replicas"]
    assert details["deployments"]["OpenAIIngress"]["status"] == "HEALTHY"


def test_auto_replicas_is_one_per_core_on_a_cluster_without_gpus(ray_cluster):
    import ray

    from cluster.app import resolve_replicas
    from cluster.config import ServeConfig

    resources = ray.cluster_resources()
    assert resources.get("GPU", 0) == 0
    assert resolve_replicas(ServeConfig()) == int(resources["CPU"]) == 2
    assert resolve_replicas(ServeConfig(num_cpus_per_replica=2)) == 1


def test_replicas_the_local_cluster_cannot_place_are_refused_before_deploying(ray_cluster):
    from cluster.config import ServeConfig
    from cluster.preflight import check_replicas_fit

    check_replicas_fit(ServeConfig(), 2)  # 2 CPUs: one replica per core fits
    check_replicas_fit(ServeConfig(num_cpus_per_replica=0.5), 4)
    check_replicas_fit(ServeConfig(num_cpus_per_replica=0.666667), 3)  # Ray counts 0.6666 each: they fit
    with pytest.raises(ValueError, match=r"3 replica\(s\) with device=cpu need 3 CPUs \(1 each\), but the local Ray cluster has 2: "
                       r"serve fewer replicas \(--replicas\), or give each rank fewer cores"):
        check_replicas_fit(ServeConfig(), 3)
    with pytest.raises(ValueError, match=r"need 2\.0001 CPUs"):
        check_replicas_fit(ServeConfig(num_cpus_per_replica=0.6667), 3)
    with pytest.raises(ValueError, match=r"of tensor_parallel_size 2 .* need 4 CPUs \(2 each\)"):
        check_replicas_fit(ServeConfig(engine={"tensor_parallel_size": 2}), 2)
    with pytest.raises(ValueError, match=r"need 3 CPUs \(3 each\), but the local Ray cluster has 2: give each rank fewer cores"):
        check_replicas_fit(ServeConfig(num_cpus_per_replica=3), 1)  # one replica: fewer replicas would not help
    autoscaled = ServeConfig(autoscaling={"min_replicas": 1, "max_replicas": 4, "initial_replicas": 3})
    with pytest.raises(ValueError, match=r"serve fewer replicas \(--autoscale's MIN, or initial_replicas\)"):
        check_replicas_fit(autoscaled, 3)
    with pytest.raises(ValueError, match=r"1 replica\(s\) with device=cuda need 1 GPU \(1 each\), but the local Ray cluster has 0: "
                       r"serve on CPU \(--device cpu\), or join a cluster"):
        check_replicas_fit(ServeConfig(engine={"device": "cuda"}), 1)
    check_replicas_fit(ServeConfig(address="ray://elsewhere:10001", engine={"device": "cuda"}), 8)  # may gain nodes: not checked


def test_a_tensor_parallel_replica_no_node_can_hold_is_refused(ray_cluster):
    """Its ranks' CPUs (and GPUs on CUDA) on one node of the real 2-CPU cluster, and its heads
    (the default model's 9 query and 3 KV heads split over 3 ranks, not 2)."""
    from cluster.config import ServeConfig
    from cluster.preflight import check_tensor_parallel

    check_tensor_parallel(ServeConfig(num_cpus_per_replica=0.666667, engine={"tensor_parallel_size": 3}))  # Ray counts 0.6666 each
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 needs 3 CPUs on one node for each replica; the largest node "
                       r"of the Ray cluster has 2; give each rank fewer cores \(num_cpus_per_replica in a config file, e\.g\. 0\.6666"):
        check_tensor_parallel(ServeConfig(engine={"tensor_parallel_size": 3}))
    with pytest.raises(ValueError, match=r"needs 3 GPUs on one node"):
        check_tensor_parallel(ServeConfig(num_cpus_per_replica=0.5, engine={"tensor_parallel_size": 3, "device": "cuda"}))
    with pytest.raises(ValueError, match=r"needs 3 CPUs on one node"):  # on CUDA each rank's CPUs count too
        check_tensor_parallel(ServeConfig(engine={"tensor_parallel_size": 3, "device": "cuda"}))
    with pytest.raises(ValueError, match=r"heads"):
        check_tensor_parallel(ServeConfig(num_cpus_per_replica=0.5, engine={"tensor_parallel_size": 2}))
