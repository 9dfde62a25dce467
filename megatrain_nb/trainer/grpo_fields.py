"""The GRPOConfig fields mt.GRPOTrainer honours, those without effect here, and the check that
refuses the rest by name: light (no torch, no transformers), so a notebook kernel checks a
GRPOConfig before it launches worker processes (notebook/launch_spec.py)."""
from __future__ import annotations

from .args import unusable_fields

# GRPOConfig fields (beyond TrainingArguments') honoured here; every other one must keep its default
GRPO_HONOURED = frozenset({
    "model_init_kwargs", "trust_remote_code", "disable_dropout", "num_generations", "max_completion_length",
    "shuffle_dataset", "generation_batch_size", "steps_per_generation", "temperature", "top_p", "top_k", "min_p",
    "generation_kwargs", "chat_template_kwargs", "repetition_penalty", "cache_implementation", "beta",
    "num_iterations", "epsilon", "delta", "epsilon_high", "sapo_temperature_neg", "sapo_temperature_pos",
    "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "importance_sampling_level",
    "reward_weights", "multi_objective_aggregation", "scale_rewards", "loss_type", "mask_truncated_completions",
    "off_policy_mask_threshold", "use_bias_correction_kl",
})
GRPO_NO_EFFECT = frozenset({
    "cast_lm_head_to_fp32",   # the head's logits are fp32 here already
    "ds3_gather_for_generation", "log_completions", "log_multimodal", "num_completions_to_print",
    "log_unique_prompts", "log_completions_hub_repo", "num_generations_eval",
    # vLLM's settings are read only with use_vllm=True (refused)
    "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
    "ref_model_mixup_alpha", "ref_model_sync_steps",   # only with sync_ref_model (refused)
    "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",   # only with entropy bonus
    "max_tool_calling_iterations",   # only with tools (refused)
})
WHY = {
    "use_vllm": "vLLM (server or colocate mode) is not used: generation runs on a resident copy of the weights with "
                "transformers' generate; set use_vllm=False (for vLLM use trl.GRPOTrainer)",
    "pad_to_multiple_of": "rollouts are padded to their longest row",
    "top_entropy_quantile": "the entropy mask needs the whole batch's entropies at once",
    "entropy_coef": "the entropy bonus is not supported yet", "use_adaptive_entropy": "the entropy bonus is not "
    "supported yet", "sync_ref_model": "the reference is the starting policy (TR-DPO's moving reference is not "
    "supported)", "router_aux_loss_coef": "Mixture-of-Experts auxiliary losses are not supported",
    "use_transformers_continuous_batching": "generation uses plain generate",
}


def validate_grpo_args(args) -> None:
    """Refuse, by name, the GRPOConfig-only fields set to something that cannot apply here."""
    from trl import GRPOConfig

    problems = unusable_fields(args, GRPOConfig, GRPO_HONOURED | GRPO_NO_EFFECT, WHY,
                               ignore=lambda name, value: name == "pad_to_multiple_of" and value is None)
    if problems:
        raise ValueError("GRPOConfig field(s) not supported by megatrain_nb: " + "; ".join(problems)
                         + ". Remove them (or set them back to their defaults); megatrain_nb never ignores a "
                         "setting silently (the supported fields are listed in megatrain_nb.trainer.grpo_fields).")


__all__ = ["GRPO_HONOURED", "GRPO_NO_EFFECT", "WHY", "validate_grpo_args"]
