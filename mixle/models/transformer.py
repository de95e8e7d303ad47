"""The main job's GPT-2 shaped causal LM (a face over ``mixle.lm.transformer``)."""

from mixle.lm.transformer import Block, CausalLM, build_causal_lm  # noqa: F401

__all__ = ["Block", "CausalLM", "build_causal_lm"]
