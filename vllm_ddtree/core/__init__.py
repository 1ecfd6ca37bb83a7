"""Engine-agnostic DDTree core: tree build, masks, acceptance walk, sampling rule, KV-compaction plan,
adaptive budget.

Imports torch only, never vLLM; every function is batched over the requests of a step.
"""

from vllm_ddtree.core.accept import TreeAcceptance, accept_tree, max_path_length
from vllm_ddtree.core.budget import (
    OFF,
    AdaptiveBudget,
    BudgetPolicy,
    StepClock,
    TreeShape,
    accepted_by_shape,
    candidate_shapes,
    chain_accepted,
    nested_shapes,
    tokens_by_shape,
)
from vllm_ddtree.core.kv_plan import KVCompactionPlan, compact_rows_, kv_compaction_plan
from vllm_ddtree.core.sampling import TreeSamplingParams, process_logits, sample_tree_tokens
from vllm_ddtree.core.tree import DraftTree, build_draft_trees, tree_attention_mask

__all__ = [
    "OFF",
    "AdaptiveBudget",
    "BudgetPolicy",
    "DraftTree",
    "KVCompactionPlan",
    "StepClock",
    "TreeAcceptance",
    "TreeSamplingParams",
    "TreeShape",
    "accept_tree",
    "accepted_by_shape",
    "build_draft_trees",
    "candidate_shapes",
    "chain_accepted",
    "compact_rows_",
    "kv_compaction_plan",
    "max_path_length",
    "nested_shapes",
    "process_logits",
    "sample_tree_tokens",
    "tokens_by_shape",
    "tree_attention_mask",
]
