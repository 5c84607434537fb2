"""The model: one definition for every supported family, the checkpoint formats it loads from (GGUF,
Hugging Face), its tokenizer and chat template, and a decode step's layers in one C call."""
