"""What a model name stands for, without torch: shapes, context length, tokenizer and chat
template, the SmolLM2 conversion, and the echo model's pieces. Edges, workers and the CLI share it."""
