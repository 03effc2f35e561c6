"""A GGUF file of the embedded tiny Llama, written as llama.cpp's converter writes one (its q/k rows permuted for
interleaved rotary halves, a byte-level vocabulary), so that model.gguf_file's conversion is tested in a second
on a real GGUF file, bit for bit against the weights it came from."""

from types import SimpleNamespace

import torch

from rlrun import models

SHAPE = dict(arch="llama", hidden_size=32, intermediate_size=64, layers=2, heads=2, kv_heads=1, max_positions=128,
             vocab_size=None, tie_embeddings=False, dtype="float32")


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permutation of a q/k projection's rows (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the tiny model of `seed` to `path` as GGUF (fp32 tensors); return its state dict."""
    import gguf

    tok = models.char_tokenizer()
    model = models.tiny_model(SimpleNamespace(**SHAPE), tok, seed)
    c, sd = model.config, model.state_dict()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t.replace(" ", "\u0120") for t in tokens])  # byte-level spelling of the space
    w.add_token_types([3 if t in models.SPECIAL else 1 for t in tokens])  # 3: control
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)

    def add(name, t):
        w.add_tensor(name, t.detach().float().numpy())

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    names = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        add(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for g, h in names.items():
            add(f"blk.{i}.{g}.weight", sd[p + h + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd
