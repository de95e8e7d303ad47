"""Program transforms (LoRA)."""
