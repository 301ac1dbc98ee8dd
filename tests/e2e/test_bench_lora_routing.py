"""``carpool bench lora-routing`` at a tiny size on the e2e cluster: both modes run on fresh apps
of 2 replicas, every request is served, and the report has its documented fields (not speed)."""

from __future__ import annotations

import json
from contextlib import contextmanager

from cluster.bench.serving.lora_routing import lora_routing_main

MODE_FIELDS = {
    "completed", "errors", "error_messages", "output_tokens", "wall_s", "output_tokens_per_s", "adapter_loads",
    "loads_per_request", "requests_per_replica", "max_replica_share",
}
NUM_REQUESTS, MAX_TOKENS = 8, 2


def test_bench_lora_routing_reports_both_modes(deploy, smollm2_path, tmp_path, capsys):
    @contextmanager
    def on_test_cluster(config, replicas):
        with deploy(config, replicas) as served:
            yield served.base_url

    result = lora_routing_main(
        model=smollm2_path, replicas=2, max_num_seqs=4, max_loras=1, num_adapters=3, num_requests=NUM_REQUESTS,
        hot=1, hot_fraction=0.5, max_tokens=MAX_TOKENS, concurrency=4, seed=3, compile=False,
        kv_cache_memory=64 << 20, max_model_len=256, adapter_dir=tmp_path / "adapters", json_path=tmp_path / "lora.json",
        deploy=on_test_cluster, timeout=240,
    )
    assert set(result["modes"]) == {"aware", "seat-only"}
    assert sum(result["requests_per_adapter"].values()) == NUM_REQUESTS and len(result["requests_per_adapter"]) <= 3
    assert NUM_REQUESTS * (MAX_TOKENS // 2) <= result["requested_output_tokens"] <= NUM_REQUESTS * (3 * MAX_TOKENS // 2)
    for mode, m in result["modes"].items():
        assert MODE_FIELDS <= m.keys(), (mode, m)
        assert m["completed"] == NUM_REQUESTS and m["errors"] == 0, m["error_messages"]
        assert m["output_tokens"] == result["requested_output_tokens"] and m["output_tokens_per_s"] > 0
        assert sum(m["requests_per_replica"].values()) == NUM_REQUESTS and len(m["requests_per_replica"]) == 2
        assert m["adapter_loads"] >= 1 and m["loads_per_request"] == m["adapter_loads"] / NUM_REQUESTS
        assert 0.5 <= m["max_replica_share"] <= 1
    floor = result["floor"]
    assert set(floor) == {"loads_per_request_ratio", "loads_met", "split_met", "met"}
    assert floor["loads_per_request_ratio"] > 0
    written = json.loads((tmp_path / "lora.json").read_text())
    assert written["modes"]["aware"]["completed"] == NUM_REQUESTS and written["num_adapters"] == 3
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["lora-0", "lora-1", "lora-2"]
    out = capsys.readouterr().out
    assert "loads/req" in out and "seat-only" in out and "floor:" in out
