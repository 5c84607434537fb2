"""OpenAI's API: completions, chat, embeddings, the utility routes, and the generation path every API shares."""
