"""Speculative decoding's torch-free parts: prompt lookup, the planner's choices, and the
scheduler's room for drafts and their rollback (block tables shrink; drafts never cached)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from replica.config.engine_config import EngineConfig
from replica.core.block_manager import BlockManager
from replica.core.drafts import reserve_drafts, set_drafts
from replica.core.request import Request
from replica.core.scheduler import Scheduler
from replica.protocol.outputs import FinishReason
from replica.protocol.sampling_params import SamplingParams
from replica.spec_decode.ngram import lookup
from replica.spec_decode.planner import DraftPlanner, StepCost


def test_lookup_copies_what_followed_the_latest_longest_match():
    tokens = np.array([5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 5, 6, 7], dtype=np.int64)
    # Suffix (5, 6, 7) occurs at 0 (followed by 8, 9); (6, 7) also at 7, but longer suffixes win.
    assert lookup(tokens, 2, 3, 4) == [8, 9, 1, 2]
    assert lookup(tokens, 2, 2, 4) == [3, 4, 5, 6]  # n = 2 only: the latest occurrence of (6, 7)
    assert lookup(tokens, 2, 3, 1) == [8]
    assert lookup(np.array([1, 2, 3, 4], dtype=np.int64), 1, 3, 4) == []  # nothing repeats
    assert lookup(np.array([3], dtype=np.int64), 1, 3, 4) == []
    # A match at the very end of the earlier text has fewer than k tokens after it.
    assert lookup(np.array([1, 2, 1, 2], dtype=np.int64), 2, 2, 4) == [1, 2]


def _planner(costs: dict[int, float]) -> DraftPlanner:
    planner = DraftPlanner(max_drafts=4)
    planner.cost.seed(list(costs), list(costs.values()))
    return planner


def test_planner_drafts_fully_when_rows_are_cheap_and_not_when_a_step_is_compute_bound():
    cheap = _planner({n: 0.025 + 0.001 * n for n in (1, 2, 4, 5, 8, 16, 32)})
    assert cheap.plan(1, 1, [("a", 4)]) == [3]  # prior acceptance 1/2: the 4th draft adds 1/16
    for _ in range(3):
        cheap.observe("a", 4, 4)
    assert cheap.plan(1, 1, [("a", 4)]) == [4]
    steep = _planner({n: 0.025 * n for n in (1, 2, 4, 5, 8, 16, 32)})  # every row costs a full step
    for _ in range(3):
        steep.observe("a", 4, 4)
    assert steep.plan(1, 1, [("a", 4)]) == [0]
    # 4 seats on a CPU (the measurement): 4 rows 29 ms, 20 rows 81.6 ms. Drafting all 4
    # rows fully would be slower; the planner gives fewer drafts than that or none.
    cpu = _planner({1: 0.0253, 4: 0.029, 5: 0.0297, 8: 0.040, 20: 0.0816})
    counts = cpu.plan(4, 4, [(r, 4) for r in "abcd"])
    assert sum(counts) < 16


def test_planner_backs_off_a_request_whose_drafts_are_rejected():
    planner = _planner({n: 0.025 + 0.005 * n for n in (1, 2, 3, 4, 5, 8)})  # a row costs a fifth of a step
    assert planner.plan(1, 1, [("a", 4)]) != [0]
    for _ in range(6):
        planner.observe("a", 4, 0)
    assert planner.acceptance("a") < 0.2
    assert planner.plan(1, 1, [("a", 4)]) == [0]
    for _ in range(6):
        planner.observe("a", 4, 4)
    assert planner.plan(1, 1, [("a", 4)]) == [4]
    planner.forget("a")
    assert planner.acceptance("a") == 0.5


def test_planner_not_adaptive_gives_what_is_available():
    planner = DraftPlanner(max_drafts=4, adaptive=False)
    assert planner.plan(3, 3, [("a", 4), ("b", 2)]) == [4, 2]


def test_step_cost_interpolates_and_learns():
    cost = StepCost()
    assert cost.estimate(8) == 8.0  # nothing known: proportional
    cost.seed([2, 10], [0.2, 1.0])
    assert cost.estimate(6) == pytest.approx(0.6)
    assert cost.estimate(14) == pytest.approx(1.4)  # past the largest: the last slope
    cost.record(2, 0.4)
    assert 0.2 < cost.estimate(2) < 0.4


def _decode_ready(scheduler: Scheduler, prompt: list[int], max_tokens: int = 20) -> Request:
    request = Request("r", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, [7])
    return request


def test_drafts_reserve_blocks_roll_back_and_are_never_cached():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    request = _decode_ready(scheduler, [1, 2, 3, 4, 5, 6])  # 6 prompt tokens + 1 output: 2 blocks
    out = scheduler.schedule()
    [row] = out.scheduled
    assert (row.start, row.num_new_tokens) == (6, 1)
    assert reserve_drafts(scheduler, out, row, 5) == 5
    set_drafts(row, [8, 9, 10])  # the proposer found fewer than reserved
    assert row.num_new_tokens == 4 and len(request.block_ids) == 3  # room for 6 + 1 + 5 tokens
    cached_before = bm.num_cached_blocks
    # The first draft is accepted, then the verification emits token 11: 2 tokens in all.
    scheduler.update_from_output(out, [8], extra_token_ids={0: [11]})
    assert request.output_token_ids == [7, 8, 11]
    assert request.num_computed_tokens == 8  # 7 known before + the accepted draft
    assert len(request.block_ids) == bm.blocks_needed(request.num_tokens) == 3
    assert bm.num_cached_blocks == cached_before  # the block that held drafts 9, 10 is not cached
    bm.check_integrity()
    scheduler.finish_request("r", FinishReason.ABORT)
    assert bm.num_free_blocks == bm.num_blocks


def test_drafts_stay_within_max_tokens_max_model_len_budget_and_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    request = _decode_ready(scheduler, [1, 2, 3, 4, 5, 6], max_tokens=4)
    out = scheduler.schedule()
    # max_tokens 4, 1 emitted: at most 3 more tokens, so 2 drafts (+ 1 token after them).
    assert reserve_drafts(scheduler, out, out.scheduled[0], 8) == 2
    bm2 = BlockManager(num_blocks=2, block_size=4)  # 8 slots for 7 known tokens: 1 draft at most
    s2 = Scheduler(bm2, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    _decode_ready(s2, [1, 2, 3, 4, 5, 6])
    out2 = s2.schedule()
    assert reserve_drafts(s2, out2, out2.scheduled[0], 8) == 1
    s3 = Scheduler(BlockManager(num_blocks=8, block_size=4), max_num_seqs=2, max_num_batched_tokens=3, max_model_len=32)
    _decode_ready(s3, [1, 2])
    out3 = s3.schedule()
    assert reserve_drafts(s3, out3, out3.scheduled[0], 8) == 2  # a 3-token budget: 1 + 2 drafts
    assert request.num_output_tokens == 1


def test_bad_speculative_configs_are_refused_naming_the_key():
    for bad, key in [
        ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "speculative_model": "x"}, "speculative_model"),
    ]:
        with pytest.raises(ValidationError, match=key):
            EngineConfig(speculative_config=bad)


def test_a_draft_model_that_cannot_serve_the_target_is_refused_from_its_files(tmp_path, smollm2_path):
    """``carpool serve`` runs this before Ray starts: a missing draft, another vocabulary size,
    another tokenizer; the target itself passes."""
    from transformers import AutoTokenizer, LlamaConfig

    from replica.config.model_files import check_draft_model

    check_draft_model(smollm2_path, smollm2_path)
    with pytest.raises(ValueError, match="speculative_config.model: model '/no/such/draft'"):
        check_draft_model(smollm2_path, "/no/such/draft")
    LlamaConfig(vocab_size=1000).save_pretrained(tmp_path / "small")
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="vocabulary has 1000 tokens, the target's 49152"):
        check_draft_model(smollm2_path, str(tmp_path / "small"))
    LlamaConfig(vocab_size=49152).save_pretrained(tmp_path / "other")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.add_tokens(["<carpool-extra>"])  # one more string: another tokenizer
    tokenizer.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_draft_model(smollm2_path, str(tmp_path / "other"))
