"""The LM job on top: the causal LM, the fine-tuning loop, data, the compare run and the CLI."""
