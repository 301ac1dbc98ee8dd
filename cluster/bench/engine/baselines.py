"""The same requests through transformers itself, for ``--compare transformers``.

* ``transformers-static``: ``model.generate`` on static batches of ``max_num_seqs`` requests in
  arrival order (left padding, greedy). A batch runs until its longest member is done
  (``min_new_tokens = max_new_tokens`` = that length, so EOS never ends it early); only each
  request's own ``max_tokens`` count as generated tokens. ``num_steps`` counts forwards (one per
  generated position of each batch), so its finish steps match Carpool's static policy.
* ``transformers-continuous``: transformers' own continuous batching
  (``ContinuousBatchingManager``, what ``generate_batch`` uses) with ``max_requests_per_batch`` =
  ``max_num_seqs`` and the same token budget; EOS disabled, each request its own
  ``max_new_tokens``. It runs its loop on its own thread; it does not count steps.

Both treat every request as arriving at the start (the seed example's E included). Latency is
seconds from the start to the end of the request's batch (static) or to its last token.
"""

from __future__ import annotations

import time

from cluster.bench.engine.runner import RequestResult, RunResult
from cluster.bench.workloads.base import BenchRequest


def load_transformers_model(llm):
    """The engine's model folder loaded plainly by transformers (its default attention), same dtype
    and device (the engine's :meth:`~replica.engine.llm_engine.LLMEngine.info`)."""
    import torch
    from transformers import AutoModelForCausalLM

    info = llm.engine.info()
    model = AutoModelForCausalLM.from_pretrained(info.model_path, dtype=getattr(torch, info.dtype))
    model.to(info.device)
    model.eval()
    return model


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def run_transformers_static(model, tokenizer, workload: list[BenchRequest], batch_size: int, *, progress: bool = True) -> RunResult:
    """transformers ``generate`` in static batches of ``batch_size`` (left padding, greedy)."""
    import torch
    from tqdm import tqdm

    pad = _pad_id(tokenizer)
    device = model.device
    ordered = sorted(workload, key=lambda r: r.arrival_step)
    results: dict[str, RequestResult] = {}
    steps = 0
    bar = tqdm(total=sum(r.max_tokens for r in ordered), desc="transformers-static", unit="tok", disable=not progress, leave=False)
    start = time.monotonic()
    with torch.inference_mode():
        for first in range(0, len(ordered), batch_size):
            batch = ordered[first : first + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            input_ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch], device=device)
            mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch], device=device)
            longest = max(r.max_tokens for r in batch)
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,  # ignore EOS, as the engine runs do
                do_sample=False,
                pad_token_id=pad,
            )
            steps += longest
            now = time.monotonic() - start
            for r in batch:
                # Finish step as Carpool's static policy counts it: the step that sampled its last token.
                results[r.id] = RequestResult(id=r.id, output_tokens=r.max_tokens, finish_step=steps - longest + r.max_tokens, latency_s=now)
            bar.update(sum(r.max_tokens for r in batch))
    wall = time.monotonic() - start
    bar.close()
    requests = [results[r.id] for r in workload]
    return RunResult.from_requests(
        "transformers-static", requests, wall_s=wall, num_steps=steps, num_seats=batch_size
    )


def has_transformers_continuous_batching(model) -> bool:
    return hasattr(model, "init_continuous_batching")


def run_transformers_continuous(
    model, tokenizer, workload: list[BenchRequest], max_num_seqs: int, max_batch_tokens: int, *, progress: bool = True
) -> RunResult:
    """transformers' own continuous batching over the same requests (all submitted at the start)."""
    from tqdm import tqdm
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pad = _pad_id(tokenizer)
    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(r.max_tokens for r in workload), eos_token_id=-1, pad_token_id=pad
    )
    # Size its KV cache for this workload: left to itself on CPU it sizes the cache from the free
    # *system* memory (most of the machine's RAM, allocated and zeroed up front).
    page = ContinuousBatchingConfig().page_size
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload)
    cb_config = ContinuousBatchingConfig(
        max_requests_per_batch=max_num_seqs,
        max_batch_tokens=max_batch_tokens,
        num_blocks=max_num_seqs * (-(-longest // page) + 1),
        allow_block_sharing=False,
    )
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        # Warm-up outside the timing (first calls, allocator).
        warm = workload[0].prompt_token_ids
        for i in range(min(max_num_seqs, len(workload))):
            manager.add_request(warm, request_id=f"warmup-{i}", max_new_tokens=4, eos_token_id=-1)
        _collect(manager, {f"warmup-{i}" for i in range(min(max_num_seqs, len(workload)))}, None)

        bar = tqdm(total=sum(r.max_tokens for r in workload), desc="transformers-continuous", unit="tok", disable=not progress, leave=False)
        start = time.perf_counter()
        for r in workload:
            manager.add_request(r.prompt_token_ids, request_id=f"bench-{r.id}", max_new_tokens=r.max_tokens, eos_token_id=-1)
        finished = _collect(manager, {f"bench-{r.id}" for r in workload}, bar)
        wall = time.perf_counter() - start
        bar.close()
    finally:
        manager.stop(block=True, timeout=10)
        if hasattr(manager, "destroy"):
            manager.destroy()
    requests = []
    for r in workload:
        output, seen_at = finished[f"bench-{r.id}"]
        if output.error is not None:
            raise RuntimeError(f"transformers continuous batching failed request {r.id}: {output.error}")
        end = output.lifespan[1] if output.lifespan[1] and output.lifespan[1] > 0 else seen_at
        requests.append(RequestResult(id=r.id, output_tokens=len(output.generated_tokens), finish_step=None, latency_s=end - start))
    return RunResult.from_requests(
        "transformers-continuous", requests, wall_s=wall, num_steps=None, num_seats=max_num_seqs
    )


def _collect(manager, ids: set[str], bar, timeout_s: float = 3600.0) -> dict:
    """Wait for every request in ``ids``; returns ``{id: (GenerationOutput, perf_counter when seen)}``."""
    finished: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"transformers continuous batching: {len(ids) - len(finished)} requests unfinished")
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching loop stopped unexpectedly")
            continue
        if result.request_id in ids and result.is_finished():
            finished[result.request_id] = (result, time.perf_counter())
            if bar is not None:
                bar.update(len(result.generated_tokens))
    return finished
