"""A tiny random Llama chat model written as one GGUF file (``write_gguf``), laid out the way
llama.cpp's converter writes real ones (a byte-level BPE tokenizer with a chat template, q/k rows
permuted for its rotary layout), so tests exercise transformers' GGUF loader in a second."""
from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a few merges (GPT-2's "Ġ" is a space), so the file has the merge list a byte-level BPE needs
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one printable character per byte, the base vocabulary
    of a byte-level BPE (every text encodes, with no unknown token)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _llama_cpp_permute(w: Any, heads: int) -> Any:
    """llama.cpp stores q/k rows with each head's rotary halves interleaved; transformers' loader
    undoes exactly this."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: str | Path, name: str = "tiny.gguf", *, seed: int = 0, hidden: int = 32,
               intermediate: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               context: int = 256) -> tuple[Path, Any]:
    """Write a seeded random Llama (tied embeddings, float32) with a ChatML template to
    ``folder/name`` and return the file and the ``LlamaForCausalLM`` it holds, to compare against."""
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = SPECIALS + _byte_tokens() + [m.replace(" ", "") for m in MERGES]
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokens), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)).eval()
    w = gguf.GGUFWriter(str(out / name), "llama")
    w.add_name("tiny-chat")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for gname, t in _gguf_tensors(model, heads, kv_heads):
        w.add_tensor(gname, np.ascontiguousarray(t.detach().float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out / name, model


def _gguf_tensors(model: Any, heads: int, kv_heads: int) -> list[tuple[str, Any]]:
    """The model's parameters under llama.cpp's tensor names (the tied output head is not stored)."""
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    out = [("token_embd.weight", model.model.embed_tokens.weight), ("output_norm.weight", model.model.norm.weight)]
    for i, layer in enumerate(model.model.layers):
        for hf, short in names.items():
            t = layer.get_submodule(hf).weight
            if short in ("attn_q", "attn_k"):
                t = _llama_cpp_permute(t.detach(), heads if short == "attn_q" else kv_heads)
            out.append((f"blk.{i}.{short}.weight", t))
    return out
