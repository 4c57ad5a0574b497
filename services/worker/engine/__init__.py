"""The engine: continuous batching over a paged KV cache. Its API is types.py, its settings settings.py;
it knows no Kafka and imports only shared/models and kernels/ from the rest of the project."""
