"""Autoscaling on seats, served: the Carpool policy on a 2-node Ray cluster on this machine.

``carpool bench autoscale``'s run (``cluster/bench/serving/autoscale.py``), in a subprocess of its own
(its own Ray cluster: a head and a worker node of 1 CPU each, one replica slot per node), with the
Carpool policy only and short windows; a real Prometheus scrapes the app. The side-by-side with
Serve's ongoing-requests policy is the bench's (``docs/bench/autoscaling-cpu.md``).

It must show: a burst of tiny requests that never keeps requests waiting does not scale up; a
step of long streams that fills the seats scales 1 → 2, and back to 1 once it ends, while a
stream runs; no request lost or cut short; exactly one decision each way (no flapping); every
remaining replica idle with all KV blocks free; the decisions in ``/metrics``, in Prometheus,
and every panel of the dashboard's autoscaling row with data.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tests.e2e.conftest import run_script

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRIPT_TIMEOUT_S = 420
BENCH = dict(
    tiny_s=6.0, settle_s=2.0, long_s=16.0, long_tokens=128, tail_s=60.0, down_timeout_s=45.0,
    look_back_s=4.0, upscale_delay_s=1.0, downscale_delay_s=4.0, cooldown_s=6.0,
)
"""Shorter phases and windows than the bench's defaults (the suite's time)."""


def main(out_path: str) -> None:
    from cluster.bench.serving.autoscale import AutoscaleBench, autoscale_main

    autoscale_main(out_path, AutoscaleBench(**BENCH), ("carpool",), PROMETHEUS)


def test_carpool_policy_scales_on_seats_not_request_counts(tmp_path):
    assert Path(PROMETHEUS).exists(), "Debian's prometheus is not installed (make test installs it)"
    out = tmp_path / "autoscale.json"
    run_script("tests.e2e.test_autoscaling", out, SCRIPT_TIMEOUT_S)
    result = json.loads(out.read_text())
    run = result["runs"]["carpool"]
    print(json.dumps({k: run[k] for k in ("deploy_s", "changes", "reasons", "tiny", "long", "record", "prometheus")}))
    assert result["nodes"] == 2

    # Tiny requests: many in flight, nobody waits long for a seat: one replica throughout.
    assert run["tiny"]["requests"]["sent"] >= 30
    assert run["tiny"]["most_replicas"] == 1, run["timeline"]
    # Long streams filling the seats: a second replica, then back to one after the step.
    assert run["long"]["most_replicas"] == 2, run["timeline"]
    assert run["final_replicas"] == 1, run["timeline"]
    assert [c[1:3] for c in run["changes"]] == [[1, 2], [2, 1]], run["changes"]  # one decision each way
    assert run["changes"][1][3] > 0, run["changes"]  # scaled down with streams in flight
    assert run["record"]["decisions"] == {"up": 1, "down": 1}

    # Nothing lost: every request complete, with all its tokens; the remaining replica idle, intact.
    for phase in ("tiny", "long"):
        requests = run[phase]["requests"]
        assert requests["failed"] == requests["truncated"] == 0, requests
        assert requests["completed"] == requests["sent"]
    assert len(run["idle"]) == 1
    assert all(s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0 for s in run["idle"])

    # The decisions in /metrics, in a real Prometheus, and on the dashboard.
    lines = run["metrics_text"]
    assert any(line.startswith('carpool:autoscaler_decisions_total{application="autoscale-carpool",direction="up"} 1.0') for line in lines), lines
    assert any(line.startswith("carpool:autoscaler_target_replicas") and line.endswith(" 1.0") for line in lines), lines
    prom = run["prometheus"]
    assert (prom["decisions_up"], prom["decisions_down"]) == (1.0, 1.0), prom
    assert prom["last_reason"] in ("cooldown", "within_targets", "down_delay", "seats_underused"), prom
    assert prom["dashboard"] and all(prom["dashboard"].values()), prom["dashboard"]


if __name__ == "__main__":
    main(sys.argv[1])
