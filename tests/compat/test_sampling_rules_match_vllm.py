"""Our processing rules are vLLM 0.32's own: compared on random logits with vLLM's functions."""

import pytest
import torch

vllm_sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")

from vllm_ddtree.core import TreeSamplingParams, process_logits


@pytest.mark.parametrize("seed", range(5))
def test_process_logits_equals_vllm_temperature_min_p_top_k_top_p(seed):
    gen = torch.Generator().manual_seed(seed)
    num_req, nodes, vocab = 6, 3, 50
    logits = torch.randn(num_req, nodes, vocab, generator=gen) * 3
    temperature = torch.rand(num_req, generator=gen) + 0.3
    top_k = torch.randint(1, vocab + 1, (num_req,), generator=gen)
    top_p = torch.rand(num_req, generator=gen) * 0.6 + 0.4
    min_p = torch.rand(num_req, generator=gen) * 0.2
    ours = process_logits(logits, TreeSamplingParams(temperature, top_k, top_p, min_p))

    rows = logits.reshape(-1, vocab).clone() / temperature.repeat_interleave(nodes).unsqueeze(1)
    probs = rows.softmax(-1)  # vLLM's MinPLogitsProcessor.apply, inline
    rows.masked_fill_(probs < probs.amax(-1, keepdim=True) * min_p.repeat_interleave(nodes).unsqueeze(1), float("-inf"))
    theirs = vllm_sampler.apply_top_k_top_p_pytorch(
        rows, top_k.repeat_interleave(nodes), top_p.repeat_interleave(nodes)
    )
    assert torch.equal(torch.isinf(ours.reshape(-1, vocab)), torch.isinf(theirs))
    torch.testing.assert_close(ours.reshape(-1, vocab).softmax(-1), theirs.softmax(-1))
