"""The model: its definition, the checkpoint formats it loads from, its tokenizer and chat template."""
