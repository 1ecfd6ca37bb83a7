"""Engine-agnostic DDTree core: tree build, masks, acceptance walk, sampling rule, KV-compaction plan,
adaptive budget, Gated DeltaNet tree scan and state compaction.

Imports torch only, never vLLM; every function is batched over the requests of a step.
"""

from vllm_ddtree.core.accept import TreeAcceptance, accept_tree, max_path_length
from vllm_ddtree.core.budget import (
    OFF,
    AdaptiveBudget,
    BudgetPolicy,
    SamplingRegimes,
    StepClock,
    TreeShape,
    accepted_by_shape,
    candidate_shapes,
    chain_accepted,
    nested_shapes,
    tokens_by_shape,
)
from vllm_ddtree.core.context_rows import unreadable_context_rows
from vllm_ddtree.core.gdn_state import (
    accepted_state_move,
    compact_conv_windows_,
    compact_recurrent_states_,
    read_conv_history,
    write_conv_window_,
)
from vllm_ddtree.core.gdn_tree import ancestor_table, gdn_gating, tree_causal_conv1d, tree_gated_delta_rule
from vllm_ddtree.core.kv_plan import KVCompactionPlan, compact_rows_, kv_compaction_plan
from vllm_ddtree.core.sampling import TreeSamplingParams, process_logits, sample_tree_tokens
from vllm_ddtree.core.tree import DraftTree, build_draft_trees, chain_token_ids_of, tree_attention_mask

__all__ = [
    "OFF",
    "AdaptiveBudget",
    "BudgetPolicy",
    "DraftTree",
    "KVCompactionPlan",
    "SamplingRegimes",
    "StepClock",
    "TreeAcceptance",
    "TreeSamplingParams",
    "TreeShape",
    "accept_tree",
    "accepted_by_shape",
    "accepted_state_move",
    "ancestor_table",
    "build_draft_trees",
    "candidate_shapes",
    "chain_accepted",
    "chain_token_ids_of",
    "compact_conv_windows_",
    "compact_recurrent_states_",
    "compact_rows_",
    "gdn_gating",
    "kv_compaction_plan",
    "max_path_length",
    "nested_shapes",
    "process_logits",
    "read_conv_history",
    "sample_tree_tokens",
    "tokens_by_shape",
    "tree_attention_mask",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "unreadable_context_rows",
    "write_conv_window_",
]
