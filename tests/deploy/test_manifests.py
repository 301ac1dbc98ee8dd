"""deploy/: the Serve config, the KubeRay RayService, the PodMonitors and the Dockerfile, without a cluster.

* ``serve_config.yaml`` is a valid Serve config (Serve's own ``ServeDeploySchema``), its ``args``
  are valid :class:`~cluster.config.ServeConfig` fields, and its ``deployments`` entries name the
  deployments :func:`cluster.app.app_builder` really builds.
* ``rayservice.yaml`` carries that same config as ``serveConfigV2`` and validates against the
  RayService CRD's OpenAPI schema (``deploy/crds``, copied from KubeRay), with a GPU worker group of
  one GPU per pod.
* The PodMonitors select the pods KubeRay creates for it, by the labels KubeRay puts on them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE_CONFIG = DEPLOY / "serve_config.yaml"
RAYSERVICE = DEPLOY / "rayservice.yaml"
CRD = DEPLOY / "crds" / "ray.io_rayservices.yaml"
PODMONITOR = DEPLOY / "prometheus" / "podmonitor.yaml"


def load(path: Path):
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def serve_config() -> dict:
    return load(SERVE_CONFIG)


@pytest.fixture(scope="module")
def rayservice() -> dict:
    return load(RAYSERVICE)


@pytest.fixture(scope="module")
def crd_validator():
    crd = load(CRD)
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema)


def replica_entry(config: dict) -> dict:
    (app,) = config["applications"]
    (entry,) = [d for d in app["deployments"] if d["name"] == "LLMReplica"]
    return entry


# ---- the Serve config -------------------------------------------------------------------------
def test_serve_config_is_a_valid_serve_config_for_app_builder(serve_config):
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT, app_builder
    from cluster.config import ServeConfig

    schema = ServeDeploySchema.model_validate(serve_config)
    (app,) = schema.applications
    assert app.import_path == "cluster.app:app_builder"
    config = ServeConfig.model_validate(app.args)
    assert config.engine.device == "cuda"

    built = app_builder(app.args)
    ingress = built._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    assert (ingress.name, replica.name) == (INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT)
    # Every override names a deployment that exists (Serve fails the deploy otherwise).
    assert {d.name for d in app.deployments} <= {INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT}
    # The code's own options agree with the config's: one GPU per replica on CUDA.
    assert replica.ray_actor_options["num_gpus"] == 1


def test_serve_config_scales_replicas_one_gpu_each(serve_config):
    """The shipped config autoscales LLMReplica with the Carpool policy (args.autoscaling), which
    app_builder turns into the deployment's autoscaling_config; no fixed count beside it."""
    from ray.serve.config import AutoscalingConfig

    from cluster.app import app_builder

    entry = replica_entry(serve_config)
    assert entry["ray_actor_options"]["num_gpus"] == 1
    assert "num_replicas" not in entry and "autoscaling_config" not in entry  # args.autoscaling decides
    (app,) = serve_config["applications"]
    replica = app_builder(app["args"])._bound_deployment.init_args[0]._bound_deployment  # ingress → replica
    scaling = replica._deployment_config.autoscaling_config
    assert isinstance(scaling, AutoscalingConfig)
    assert 1 <= scaling.min_replicas < scaling.max_replicas
    assert scaling.policy.policy_function == "cluster.autoscaling.policy:CarpoolAutoscalingPolicy"
    assert scaling.policy.policy_kwargs["upscale_delay_s"] == app["args"]["autoscaling"]["upscale_delay_s"]
    # Requests queue in the engine (its queue wait is what the policy reads), not in Serve.
    assert app["args"]["engine"]["max_num_seqs"] < entry["max_ongoing_requests"]


# ---- the RayService ---------------------------------------------------------------------------
def test_rayservice_serves_the_same_config(rayservice, serve_config):
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == serve_config


def test_rayservice_validates_against_the_crd_schema(rayservice, crd_validator):
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in crd_validator.iter_errors(rayservice)]
    assert errors == []


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].__setitem__("maxReplicas", "four"), "maxReplicas"),
        (lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
        (lambda rs: rs["spec"].__setitem__("serveConfigV2", {"applications": []}), "serveConfigV2"),
        (lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"].__setitem__("rayStartParams", ["num-cpus=0"]), "rayStartParams"),
    ],
)
def test_a_broken_rayservice_fails_the_schema(rayservice, crd_validator, mutate, where):
    broken = copy.deepcopy(rayservice)
    mutate(broken)
    errors = list(crd_validator.iter_errors(broken))
    assert errors, f"mutating {where} should fail validation"
    assert any(where in [str(p) for p in e.path] or where in e.message for e in errors)


def containers(group: dict) -> dict:
    return {c["name"]: c for c in group["template"]["spec"]["containers"]}


def ports(container: dict) -> dict:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_rayservice_groups_ports_and_probes(rayservice, serve_config):
    import ray

    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    assert f"FROM rayproject/ray:{ray.__version__}-py311-" in (DEPLOY / "Dockerfile").read_text()

    head = cluster["headGroupSpec"]
    head_ports = ports(containers(head)["ray-head"])
    assert head_ports["serve"] == 8000 and head_ports["dashboard"] == 8265 and head_ports["metrics"] == 8080
    assert head["rayStartParams"]["num-cpus"] == "0"  # replicas go to the GPU workers

    (gpu,) = cluster["workerGroupSpecs"]
    worker = containers(gpu)["ray-worker"]
    assert ports(worker)["serve"] == 8000
    for kind in ("requests", "limits"):
        assert int(worker["resources"][kind]["nvidia.com/gpu"]) == 1  # one GPU per pod, one replica per GPU
    probe = worker["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/-/healthz", 8000)  # Serve's proxy health path

    scaling = serve_config["applications"][0]["args"]["autoscaling"]
    assert (gpu["minReplicas"], gpu["maxReplicas"]) == (scaling["min_replicas"], scaling["max_replicas"])
    assert cluster["enableInTreeAutoscaling"] is True


def test_rayservice_ports_and_images_agree(rayservice, serve_config):
    """One Serve port everywhere (the config's http_options, both containers, the probe, the
    PodMonitor), reachable from outside the pod; Ray's metrics export port is the containers'
    metrics port; every pod runs the same CUDA image; GPU pods tolerate the GPU taint."""
    http = serve_config["http_options"]
    assert http["host"] == "0.0.0.0"  # 127.0.0.1 would be unreachable through the Service
    assert serve_config.get("proxy_location", "EveryNode") == "EveryNode"
    cluster = rayservice["spec"]["rayClusterConfig"]
    head, (gpu,) = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    head_c, worker_c = containers(head)["ray-head"], containers(gpu)["ray-worker"]
    assert ports(head_c)["serve"] == ports(worker_c)["serve"] == http["port"]
    assert worker_c["readinessProbe"]["httpGet"]["port"] == http["port"]
    metrics_port = int(head["rayStartParams"]["metrics-export-port"])
    assert ports(head_c)["metrics"] == ports(worker_c)["metrics"] == metrics_port
    assert int(gpu["rayStartParams"].get("metrics-export-port", metrics_port)) == metrics_port
    assert head_c["image"] == worker_c["image"]
    assert head["rayStartParams"].get("num-gpus") == "0"
    assert any(t.get("key") == "nvidia.com/gpu" for t in gpu["template"]["spec"].get("tolerations", []))
    import re

    base = re.search(r"^FROM rayproject/ray:(\S+)", (DEPLOY / "Dockerfile").read_text(), re.M).group(1)
    assert base.endswith("-gpu") or "-cu" in base, base  # a CUDA image: replicas run on GPUs


# ---- the PodMonitors --------------------------------------------------------------------------
def kuberay_pod_labels(rayservice: dict, node_type: str, group: dict, cluster_name: str) -> dict:
    """The labels KubeRay puts on a Ray pod: ``labelPod`` in ray-operator/controllers/ray/common/
    pod.go (ray.io/is-ray-node, ray.io/cluster, ray.io/node-type, ray.io/group, ray.io/identifier,
    app.kubernetes.io/name and created-by), the template's own labels, and ``BuildPod``'s
    ray.io/serve for RayService pods."""
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster_name,
        "ray.io/node-type": node_type,
        "ray.io/group": group.get("groupName", "headgroup"),
        "ray.io/identifier": f"{cluster_name}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    for key, value in (group["template"].get("metadata", {}).get("labels") or {}).items():
        if key not in ("ray.io/node-type", "ray.io/group", "ray.io/cluster"):  # not overridable
            labels[key] = value
    labels["ray.io/serve"] = "false" if node_type == "head" else "true"
    return labels


def selects(monitor: dict, labels: dict) -> bool:
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_podmonitors_select_the_rayservice_pods(rayservice):
    monitors = {m["metadata"]["name"]: m for m in yaml.safe_load_all(PODMONITOR.read_text())}
    assert {m["kind"] for m in monitors.values()} == {"PodMonitor"}
    cluster = rayservice["spec"]["rayClusterConfig"]
    name = rayservice["metadata"]["name"] + "-x7k2p"  # KubeRay names the RayCluster <RayService>-<suffix>
    head_group = cluster["headGroupSpec"]
    (gpu_group,) = cluster["workerGroupSpecs"]
    head = kuberay_pod_labels(rayservice, "head", head_group, name)
    worker = kuberay_pod_labels(rayservice, "worker", gpu_group, name)
    other_head = kuberay_pod_labels(rayservice, "head", {"template": {}}, "someone-else")

    # carpool:* series: the head pod's Serve port only (its /metrics merges every replica's series).
    carpool = monitors["carpool"]
    assert selects(carpool, head) and not selects(carpool, worker) and not selects(carpool, other_head)
    (endpoint,) = carpool["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in ports(containers(head_group)["ray-head"])
    assert ports(containers(head_group)["ray-head"])[endpoint["port"]] == 8000

    # Ray's own metrics: every Carpool Ray pod's metrics port.
    ray_metrics = monitors["carpool-ray"]
    assert selects(ray_metrics, head) and selects(ray_metrics, worker) and not selects(ray_metrics, other_head)
    (endpoint,) = ray_metrics["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports(containers(head_group)["ray-head"])
    assert endpoint["port"] in ports(containers(gpu_group)["ray-worker"])


def test_serve_settings_equal_cluster_app_serve_env(serve_config):
    """cluster.app.SERVE_ENV reaches a cluster deployed from the Serve config (the app's
    runtime_env) and every process of the image (its ENV instruction)."""
    from cluster.app import SERVE_ENV

    assert serve_config["applications"][0]["runtime_env"]["env_vars"] == SERVE_ENV
    env_lines = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("ENV ")]
    image_env = dict(pair.split("=", 1) for line in env_lines for pair in line[len("ENV "):].split())
    assert {k: v for k, v in image_env.items() if k.startswith("RAY_SERVE_")} == SERVE_ENV
