"""bench floor: the FLOP counts behind the compute floor of the peers workloads."""

import argparse

from bench import floor


def _args(**overrides):
    p = argparse.ArgumentParser()
    floor.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()])


def test_prompt_tokens_equal_what_ideal_caching_computes():
    counts = floor.workload_counts(_args())
    # fleet: the system prompt once, 128 private tokens per agent, then 1 + 16 tokens per later turn
    # (the figure `bench peers` reports as radixserve's computed prompt tokens).
    assert counts["fleet"]["prompt_tokens"] == 2048 + 64 * (128 + 3 * 17) == 13_504
    assert counts["gsp"]["prompt_tokens"] == 16 * 1024 + 16 * 8 * 128
    assert counts["gsp"]["tokens"] == counts["gsp"]["prompt_tokens"] + 16 * 8 * 7  # plus 7 decodes each
    assert counts["gsp"]["sampled_rows"] == 16 * 8 * 8


def test_visible_keys_match_a_brute_force_count():
    args = _args(agents=2, system_tokens=5, private_tokens=3, turns=2, output_tokens=2, gsp_groups=1, gsp_prompts=2, gsp_prefix=4, gsp_question=2, gsp_output=3)
    counts = floor.workload_counts(args)
    # gsp by hand: prefix 4 causal (1+2+3+4); each question sees 4 + its own causal part (5, 6),
    # then 2 decodes at contexts 7 and 8.
    assert counts["gsp"]["visible_keys"] == 10 + 2 * (5 + 6 + 7 + 8)
    # fleet by hand: system 5 causal = 15; per agent: private 3 after 5 (6+7+8), 1 decode (9);
    # turn 1: 17 new after 9 (10..26), 1 decode (27).
    per_agent = (6 + 7 + 8) + 9 + sum(range(10, 27)) + 27
    assert counts["fleet"]["visible_keys"] == 15 + 2 * per_agent


def test_flops_scale_with_the_model_shape():
    cfg = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16, vocab_size=10)
    shape = floor.Shape(cfg)
    # q 8x8, k/v 8x4, o 8x8, gate/up 8x16, down 16x8: 64+32+32+64+128+128+128 = 576 MACs per layer
    assert shape.linear_flops(3) == 2 * 3 * 2 * 576
    assert shape.attention_flops(7) == 4 * 7 * 4 * 2 * 2
    assert shape.lm_head_flops(5) == 2 * 5 * 8 * 10
