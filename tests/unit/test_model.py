"""LlamaModel: the same logits as transformers on the same folder; the paged path equal to the
dense pass token for token; SmolLM2 knows its capitals; shapes, loading and cache sizing."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.model import (
    LlamaModel,
    allocate_kv_cache,
    kv_bytes_per_block,
)
from services.worker.engine.weights import load_model
from shared.models.shapes import SHAPES, ModelConfig, shape_config
from shared.models.smollm2 import smollm2_folder
from shared.models.spec import resolve_model

BLOCK_SIZE = 16


def save_hf_folder(config: ModelConfig, folder: Path, max_shard_size: str | None = None) -> None:
    """A Hugging Face folder made by transformers itself, with SmolLM2's tokenizer."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**config.to_hf())).float()
    if max_shard_size:
        hf.save_pretrained(folder, max_shard_size=max_shard_size)
    else:
        hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder() / name, folder / name)


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


TINY = SHAPES["tiny"]
TINY_VARIANTS = {
    "tied": (TINY, None),
    "untied-sharded": (dataclasses.replace(TINY, tie_word_embeddings=False), "2MB"),
    "llama3-rope": (
        dataclasses.replace(
            TINY,
            rope_theta=500000.0,
            max_position_embeddings=16384,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        ),
        None,
    ),
}


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_tiny_matches_transformers(tmp_path: Path, variant: str) -> None:
    config, shard = TINY_VARIANTS[variant]
    save_hf_folder(config, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    model, _ = load_model(resolve_model(str(tmp_path)))
    assert model.config.rope_scaling == config.rope_scaling
    assert model.config.tie_word_embeddings == config.tie_word_embeddings
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    ours = model.dense_forward(ids)
    assert ours.dtype == torch.float32 and ours.shape == (40, config.vocab_size)
    torch.testing.assert_close(ours, hf_logits(tmp_path, ids), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(resolve_model("smollm2"), dtype=torch.float32)


def test_smollm2_matches_transformers(smollm2) -> None:
    model, tok = smollm2
    ids = torch.tensor(tok.encode("The quick brown fox jumps over"))
    torch.testing.assert_close(model.dense_forward(ids), hf_logits(smollm2_folder(), ids), atol=2e-3, rtol=1e-4)


def test_smollm2_knows_the_capital_of_france(smollm2) -> None:
    model, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor(prompt)
    answer = ""
    while len(ids) < len(prompt) + 8 and "Paris" not in answer:
        next_id = model.dense_forward(ids)[-1].argmax()
        if int(next_id) in tok.eos_token_ids:
            break
        ids = torch.cat([ids, next_id[None]])
        answer = tok.decode(ids[len(prompt):].tolist())
    assert "Paris" in answer


# --- paged path against the dense pass ---------------------------------------------------------


class PagedSequence:
    """One sequence's tokens and blocks, as the engine would track them."""

    def __init__(self, tokens: list[int], blocks: list[int]) -> None:
        self.tokens, self.blocks, self.num_computed = list(tokens), blocks, 0


def build_step(chunks: list[tuple[PagedSequence, int]], max_blocks: int):
    """Flat inputs and metadata for one step that runs `n` new tokens of each sequence, and
    which (sequence, position) each row is."""
    ids, positions, slots, cu, context_lens, tables, rows = [], [], [], [0], [], [], []
    for seq, n in chunks:
        for pos in range(seq.num_computed, seq.num_computed + n):
            ids.append(seq.tokens[pos])
            positions.append(pos)
            rows.append((seq, pos))
            slots.append(seq.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        seq.num_computed += n
        cu.append(cu[-1] + n)
        context_lens.append(seq.num_computed)
        tables.append(seq.blocks + [0] * (max_blocks - len(seq.blocks)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        max_query_len=max(n for _, n in chunks),
    )
    return torch.tensor(ids), torch.tensor(positions), meta, rows


def run_paged(model: LlamaModel, steps: list[list[tuple[PagedSequence, int]]], num_blocks: int, decode_steps: int):
    """Prefill in the given chunks, then greedy decode; returns each sequence's logits by position."""
    caches = allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, "cpu", torch.float32)
    seqs = list(dict.fromkeys(seq for step in steps for seq, _ in step))
    logits = {id(s): {} for s in seqs}

    def run(chunks, expect_decode_only: bool) -> None:
        ids, positions, meta, rows = build_step(chunks, max_blocks=max(len(s.blocks) for s in seqs))
        assert meta.decode_only == expect_decode_only
        with torch.no_grad():
            out = model.compute_logits(model(ids, positions, meta, caches))  # (T, V)
        for row, (seq, pos) in enumerate(rows):
            logits[id(seq)][pos] = out[row]
        for seq, _ in chunks:  # greedy-extend any sequence whose prompt is now all in cache
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(int(logits[id(seq)][seq.num_computed - 1].argmax()))

    for chunks in steps:
        run(chunks, expect_decode_only=all(n == 1 for _, n in chunks))
    for _ in range(decode_steps):
        run([(s, 1) for s in seqs], expect_decode_only=True)
    return seqs, logits


def assert_matches_dense(model: LlamaModel, seq: PagedSequence, logits: dict[int, torch.Tensor]) -> None:
    dense = model.dense_forward(torch.tensor(seq.tokens[: seq.num_computed]))
    assert sorted(logits) == list(range(seq.num_computed))
    for pos, row in logits.items():
        torch.testing.assert_close(row, dense[pos], atol=1e-4, rtol=1e-4, msg=f"position {pos}")


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return load_model(resolve_model("tiny"))[0]


def test_paged_chunked_prefill_then_decode_equals_dense(tiny: LlamaModel) -> None:
    order = torch.randperm(12, generator=torch.Generator().manual_seed(2)).tolist()  # shuffled blocks
    prompt = torch.randint(0, TINY.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = PagedSequence(prompt, order[:4])  # 37 + 6 tokens fit in 3 blocks; one to spare
    (seq,), logits = run_paged(tiny, [[(seq, 10)], [(seq, 17)], [(seq, 10)]], num_blocks=12, decode_steps=6)
    assert seq.num_computed == 43
    assert_matches_dense(tiny, seq, logits[id(seq)])


def test_two_sequences_packed_in_one_batch(tiny: LlamaModel) -> None:
    order = torch.randperm(16, generator=torch.Generator().manual_seed(4)).tolist()
    gen = torch.Generator().manual_seed(5)
    a = PagedSequence(torch.randint(0, TINY.vocab_size, (30,), generator=gen).tolist(), order[0:3])
    b = PagedSequence(torch.randint(0, TINY.vocab_size, (21,), generator=gen).tolist(), order[3:6])
    # step 1: both prefill; step 2: a finishes its prompt while b already decodes (mixed batch)
    steps = [[(a, 16), (b, 21)], [(a, 14), (b, 1)]]
    (a, b), logits = run_paged(tiny, steps, num_blocks=16, decode_steps=5)
    assert_matches_dense(tiny, a, logits[id(a)])
    assert_matches_dense(tiny, b, logits[id(b)])


# --- shapes, loading and sizing -----------------------------------------------------------------


def test_named_shapes_have_the_real_models_parameter_counts() -> None:
    assert shape_config("llama-1b").num_params() == 1_235_814_400  # Llama-3.2-1B
    assert shape_config("llama-8b").num_params() == 8_030_261_248  # Llama-3.1-8B
    with pytest.raises(ValueError, match="known shapes"):
        shape_config("llama-70b")


def test_from_hf_reads_llama3_config() -> None:
    hf = {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    }
    config = ModelConfig.from_hf(hf)
    assert config.head_dim == 64 and config.rope_theta == 500000.0
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert dataclasses.replace(config, bos_token_id=1, eos_token_ids=(2,)) == SHAPES["llama-1b"]
    assert ModelConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_random_weights_are_seeded_and_in_the_asked_dtype() -> None:
    a, tok = load_model(resolve_model("tiny"), seed=0)
    b, _ = load_model(resolve_model("tiny"), seed=0)
    c, _ = load_model(resolve_model("tiny"), seed=1)
    assert torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    assert 0.015 < a.layers[0].mlp.gate_up_proj.weight.std() < 0.025
    assert torch.equal(a.norm.weight, torch.ones(TINY.hidden_size))
    half, _ = load_model(resolve_model("tiny"), dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.rotary.cos_sin.dtype == torch.float32  # positions stay exact
    ids = torch.tensor(tok.encode("Hello there"))
    assert torch.isfinite(half.dense_forward(ids)).all()
    assert tok.vocab_size == TINY.vocab_size


def test_unknown_model_spec_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither"):
        resolve_model(str(tmp_path / "nowhere"))


def test_kv_cache_allocation_and_block_bytes() -> None:
    caches = allocate_kv_cache(TINY, num_blocks=5, block_size=BLOCK_SIZE, device="cpu", dtype=torch.bfloat16)
    assert len(caches) == TINY.num_layers
    assert caches[0][0].shape == (5, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim)
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)
    assert kv_bytes_per_block(TINY, BLOCK_SIZE, torch.bfloat16) * 5 == total
    # Llama-3.1-8B in bf16: 128 KiB per token, 2 MiB per 16-token block.
    assert kv_bytes_per_block(SHAPES["llama-8b"], 16, torch.bfloat16) == 2 * 1024 * 1024
