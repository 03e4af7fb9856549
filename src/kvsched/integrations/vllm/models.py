"""Tiny local models with seeded random weights for running vLLM here (no download).

Shapes follow what vLLM's CPU build accepts: attention head size 64 (16 is refused), a
block size that is a multiple of 32; Qwen3-Next in bfloat16 with linear key/value head
dims 128 (the CPU gated-DeltaNet kernel's only size). A local WordLevel tokenizer is saved
beside the weights so that vLLM's tokenizer-dependent paths work; prompts are token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 512

# vLLM keeps a hybrid model's SSM state in float32 on CPUs with AVX-512 BF16 (its GDN path)
# and in the model's 16-bit dtype on others, which changes the block size it derives from the
# state page (640 tokens against 384 for the tiny Qwen3-Next): pinned, so runs and tests
# agree on every CPU.
STATE_DTYPE = "float32"


# The last ids of the JSON tokenizer: single characters, enough to write JSON objects, arrays,
# strings of a few letters and integers.
JSON_CHARS = '{}[]":, 0123456789abcdefxyz-'


def words(json_chars: bool = False) -> list[str]:
    """Each token's text in the tiny vocabulary: token ``i`` reads ``t{i}``; with
    ``json_chars`` the last ids read the characters of ``JSON_CHARS`` instead (for
    structured outputs: a grammar can then write JSON)."""
    texts = [f"t{i}" for i in range(VOCAB)]
    if json_chars:
        texts[VOCAB - len(JSON_CHARS) :] = list(JSON_CHARS)
    return texts


def _save_tokenizer(path: Path, json_chars: bool = False) -> None:
    """A word-level tokenizer of the tiny vocabulary (``words``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(words(json_chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "t0",
                "eos_token": "t1",
                "model_max_length": 1 << 16,
            }
        )
    )


# Shapes both models share: the vocabulary, widths, attention heads and special tokens.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


def _qwen3(**over: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3", **_COMMON, num_hidden_layers=2, torch_dtype="float32", **over
    )


def _qwen3_next(**over: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_next",
        **_COMMON,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=4,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        torch_dtype="bfloat16",
        **over,
    )


def build(kind: str, path: str | Path, seed: int = 0, json_chars: bool = False) -> Path:
    """Write a ``kind`` ("qwen3" or "qwen3-next") model with seeded random weights (and,
    with ``json_chars``, the tokenizer whose last ids are JSON characters)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    config = {"qwen3": _qwen3, "qwen3-next": _qwen3_next}[kind]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():  # wide logits: greedy choices are not decided by rounding
        model.lm_head.weight.normal_(0.0, 0.5)
    dtype = torch.bfloat16 if kind == "qwen3-next" else torch.float32
    model.to(dtype).save_pretrained(path)
    _save_tokenizer(path, json_chars)
    return path


def build_lora(path: str | Path, seed: int, rank: int = 8) -> Path:
    """Write a LoRA adapter (PEFT's layout) for the tiny "qwen3" model: seeded random
    updates of every layer's query and value projections, large enough to change greedy
    tokens."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    if (path / "adapter_config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = _qwen3()
    width = config.hidden_size
    outs = {
        "q_proj": config.num_attention_heads * config.head_dim,
        "v_proj": config.num_key_value_heads * config.head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for name, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, width, generator=generator)
            weights[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator)
    save_file(weights, str(path / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(outs),
        "bias": "none",
        "base_model_name_or_path": "tiny-qwen3",
        "task_type": "CAUSAL_LM",
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    return path


def build_eagle3(path: str | Path, target: str | Path, seed: int = 1) -> Path:
    """Write an EAGLE3 draft head for the tiny "qwen3" model at ``target`` (vLLM's
    ``eagle3`` method, its Llama-style head): one decoder layer whose attention reads the
    token's embedding and the hidden state together (small seeded random weights), an
    identity ``fc`` from the target's hidden state after its first layer (one auxiliary
    state: ``eagle_aux_hidden_state_layer_ids``), and the target's own ``lm_head``: it
    drafts what the target's first layer would predict, so decodes accept some drafts and
    reject others. The embeddings are the target's."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    c = _qwen3()
    width, inner, head = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.01) -> Any:
        return torch.randn(*shape, generator=generator) * std

    layer = "layers.0."
    weights = {
        f"{layer}self_attn.q_proj.weight": rand(q, 2 * width),
        f"{layer}self_attn.k_proj.weight": rand(kv, 2 * width),
        f"{layer}self_attn.v_proj.weight": rand(kv, 2 * width),
        f"{layer}self_attn.o_proj.weight": rand(width, q),
        f"{layer}mlp.gate_proj.weight": rand(inner, width),
        f"{layer}mlp.up_proj.weight": rand(inner, width),
        f"{layer}mlp.down_proj.weight": rand(width, inner),
        f"{layer}input_layernorm.weight": torch.ones(width),
        f"{layer}post_attention_layernorm.weight": torch.ones(width),
        f"{layer}hidden_norm.weight": torch.ones(width),
        "norm.weight": torch.ones(width),
        "fc.weight": torch.eye(width),
        "lm_head.weight": load_file(str(Path(target) / "model.safetensors"))["lm_head.weight"],
    }
    save_file(weights, str(path / "model.safetensors"))
    config = c.to_dict() | {
        "architectures": ["Eagle3LlamaForCausalLM"],
        "num_hidden_layers": 1,
        "layer_types": ["full_attention"],
        "eagle_aux_hidden_state_layer_ids": [1],
        "num_aux_hidden_states": 1,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


AUDIO_TOKENS = ("<|endoftext|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>")


def build_audio(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny Qwen2-Audio model (a multimodal model vLLM's CPU build runs without
    torchvision, whose CPU wheel this machine lacks): a two-layer Whisper-style audio
    encoder and a two-layer Qwen2 decoder with seeded random weights, its feature extractor
    and a word-level tokenizer whose last ids are the audio special tokens
    (``AUDIO_TOKENS``); a prompt's ``<|AUDIO|>`` becomes one position per encoder output."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    path = Path(path)
    if (path / "config.json").exists():
        return path
    first = VOCAB - len(AUDIO_TOKENS)
    ids = {token: first + i for i, token in enumerate(AUDIO_TOKENS)}
    text = {k: v for k, v in _COMMON.items() if k not in ("head_dim", "bos_token_id")}
    config = Qwen2AudioConfig(
        text_config={**text, "model_type": "qwen2", "num_hidden_layers": 2, "eos_token_id": 1},
        audio_config={
            "d_model": 64,
            "encoder_layers": 2,
            "encoder_attention_heads": 1,
            "encoder_ffn_dim": 128,
            "num_mel_bins": 128,
        },
        audio_token_index=ids["<|AUDIO|>"],
    )
    torch.manual_seed(seed)
    model: Any = Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():  # wide logits, and audio embeddings that move them
        model.lm_head.weight.normal_(0.0, 0.5)
        model.model.multi_modal_projector.linear.weight.normal_(0.0, 0.5)
    model.to(torch.float32).save_pretrained(path)
    # vLLM reads the decoder's weights under language_model.model (transformers 5 writes
    # language_model.model.model).
    weights = path / "model.safetensors"
    renamed = {
        k.replace("language_model.model.model.", "language_model.model."): v
        for k, v in load_file(str(weights)).items()
    }
    save_file(renamed, str(weights), metadata={"format": "pt"})
    WhisperFeatureExtractor(feature_size=128).save_pretrained(path)  # type: ignore[no-untyped-call]
    vocab = {word: i for i, word in enumerate(words()[:first])} | ids
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in AUDIO_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "t0",
        "eos_token": "t1",
        "model_max_length": 1 << 16,
        "processor_class": "Qwen2AudioProcessor",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path
