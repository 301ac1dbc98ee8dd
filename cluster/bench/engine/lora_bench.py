"""``carpool bench lora``: requests of several LoRA adapters mixed with base requests, against the
base model alone, side by side.

For each seat count, two engines of the same settings: ``base`` (no LoRA) and ``lora``
(``enable_lora``, ``max_loras`` = the adapters). The seed mix runs three ways, in turn, twice
(the best run of each is kept): base-only on ``base``; base-only on ``lora`` (what enabling LoRA
costs a replica that serves no adapter); and mixed on ``lora``, request ``i`` with adapter
``i % (adapters + 1)`` (the last share is the base model). The adapters are random rank-``rank``
PEFT adapters on every linear layer of the decoder layers (``all-linear``), made with ``peft``.
Also the cost of a run-time load: reading and checking one new adapter
(``AsyncLLMEngine.check_lora``'s work) and writing it into a device slot.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from cluster.bench.engine.runner import bench_engine_kwargs
from cluster.bench.workloads.base import seed_mix, tokenize

ROUNDS = 2
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_random_adapters(model_path: str, out_dir: Path, count: int, rank: int, seed: int = 0) -> list[str]:
    """``count`` random PEFT LoRA adapters of ``rank`` (``lora_alpha = 2 * rank``) for the model at
    ``model_path``, on :data:`TARGETS` where the model has them (else every linear layer), saved
    under ``out_dir``; returns their folders. Made with ``peft`` (``init_lora_weights=False``:
    random A and B, so they change the tokens)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for k in range(count):
        torch.manual_seed(seed + k)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
        targets = [t for t in TARGETS if t in names] or "all-linear"
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        path = out_dir / f"adapter-{k}"
        get_peft_model(model, config).save_pretrained(str(path))
        paths.append(str(path))
    return paths


def _run(llm, workload, loras) -> dict:
    """All of ``workload`` at once, request ``i`` with ``loras[i]``; tok/s."""
    from replica import SamplingParams

    engine = llm.engine
    requests = [
        engine.add_request(prompt_token_ids=item.prompt_token_ids, lora_request=lora,
                           sampling_params=SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True))
        for item, lora in zip(workload, loras)
    ]
    started = time.monotonic()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.monotonic() - started
    tokens = sum(r.num_output_tokens for r in requests)
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": steps}


def _load_cost(llm, model_path: str, rank: int, out_dir: Path) -> dict:
    """Seconds to read and check one new adapter (``LLMEngine.add_lora``), and to write it into a
    slot (``LLMEngine.activate_lora``, on the idle engine)."""
    from replica import LoRARequest

    path = make_random_adapters(model_path, out_dir / "late", 1, rank, seed=1000)[0]
    request = LoRARequest("late", 0, path)
    started = time.perf_counter()
    llm.engine.add_lora(request)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    written = llm.engine.activate_lora(request)
    write_s = time.perf_counter() - started
    if not written:
        raise RuntimeError("the new adapter was already in a slot: its write was not timed")
    return {"read_s": read_s, "slot_write_s": write_s, "total_s": read_s + write_s}


def lora_main(
    *, model: str | None, dtype: str, seats: list[int], num_adapters: int, rank: int, num_requests: int,
    threads: int, compile: bool, json_path: Path | None, device: str = "cpu",
) -> dict:
    """Run the comparison (see the module docstring); print a table; returns the results."""
    from replica import LLM, LoRARequest
    from replica.config.engine_config import DEFAULT_MODEL
    from replica.config.model_files import resolve_model_path

    model_path = resolve_model_path(model or DEFAULT_MODEL)
    results: dict = {"adapters": num_adapters, "rank": rank, "threads": threads, "device": device, "runs": []}
    with tempfile.TemporaryDirectory(prefix="carpool-lora-bench-") as tmp:
        paths = make_random_adapters(model_path, Path(tmp), num_adapters, rank)
        adapters = [LoRARequest(f"adapter-{k}", k + 1, p) for k, p in enumerate(paths)]
        for n_seats in seats:
            kwargs = bench_engine_kwargs(
                model=model_path, dtype=dtype, device=device, max_num_seqs=n_seats, max_num_batched_tokens=512,
                kv_cache_memory=None, attention_backend="auto", compile=compile, threads=threads,
            )
            base = LLM(**kwargs)
            lora = LLM(**kwargs, enable_lora=True, max_loras=num_adapters, max_lora_rank=rank)
            workload = seed_mix(max(num_requests, 2 * n_seats))
            tokenize(workload, base.tokenizer)
            mixed = [(adapters + [None])[i % (num_adapters + 1)] for i in range(len(workload))]
            none = [None] * len(workload)
            cases = {"base": (base, none), "lora_engine_base_only": (lora, none), "lora_engine_mixed": (lora, mixed)}
            warm = [type(w)(**{**w.__dict__, "max_tokens": 8}) for w in workload[:n_seats]]
            for llm, loras in cases.values():  # untimed: first-call costs, adapters into their slots
                _run(llm, warm, loras[:n_seats])
            rounds = {name: [] for name in cases}
            for _ in range(ROUNDS):
                for name, (llm, loras) in cases.items():
                    rounds[name].append(_run(llm, workload, loras))
            best = {name: max(runs, key=lambda r: r["tok_s"]) for name, runs in rounds.items()}
            run = {
                "seats": n_seats, **best,
                "mixed_over_base": best["lora_engine_mixed"]["tok_s"] / best["base"]["tok_s"],
                "lora_base_only_over_base": best["lora_engine_base_only"]["tok_s"] / best["base"]["tok_s"],
                "mixed_over_base_by_round": [m["tok_s"] / b["tok_s"] for m, b in zip(rounds["lora_engine_mixed"], rounds["base"])],
            }
            results["runs"].append(run)
            print(
                f"seats {n_seats:2d}: base {best['base']['tok_s']:7.1f} tok/s, LoRA engine base-only "
                f"{best['lora_engine_base_only']['tok_s']:7.1f} ({run['lora_base_only_over_base']:.2f}x), "
                f"{num_adapters} adapters + base mixed {best['lora_engine_mixed']['tok_s']:7.1f} "
                f"({run['mixed_over_base']:.2f}x; by round {', '.join(f'{x:.2f}' for x in run['mixed_over_base_by_round'])})",
                flush=True,
            )
            if n_seats == seats[-1]:
                results["load"] = _load_cost(lora, model_path, rank, Path(tmp))
                load = results["load"]
                print(f"run-time load of a rank-{rank} adapter: read and check {load['read_s'] * 1e3:.0f} ms, "
                      f"slot write {load['slot_write_s'] * 1e3:.0f} ms", flush=True)
            base.close()
            lora.close()
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
    return results
