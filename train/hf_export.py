"""The model in Hugging Face's layout: a directory ``transformers`` loads as ``GPT2LMHeadModel`` (``arch: gpt2``) or
``LlamaForCausalLM`` (``arch: llama``) without custom code.

``arch: gpt2`` is architecturally GPT-2: learned absolute positions, pre-LayerNorm blocks with biases (eps 1e-5), a
GELU MLP of width 4·n_embd (tanh-approximated by default, GPT-2's ``gelu_new``; ``model.activation: gelu``, the
exact form, is GPT2Config's ``gelu``), one fused q/k/v projection split in q, k, v order, and the output projection
tied to the token embedding. So the conversion is a renaming, plus a transpose: GPT-2 stores its linear layers as
``Conv1D`` with weights laid out (in, out) where ``nn.Linear`` has (out, in).
A model GPT-2 cannot express (``bias: false``) is refused rather than exported wrong.

``arch: llama`` is transformers' Llama: rotary positions on the two halves of each head (``rotate_half``, the layout
train/model.py uses, so no permutation), RMSNorm, SwiGLU as gate/up/down, grouped-query attention, no biases. The
conversion splits our fused q/k/v projection into q_proj, k_proj and v_proj; ``rope_theta`` and the context length
(``block_size``, the final one under a context schedule) go into LlamaConfig.

The export is built with ``transformers`` itself (``GPT2LMHeadModel.save_pretrained``,
``PreTrainedTokenizerFast.save_pretrained``, ``GenerationConfig``), so the files are what its loaders expect,
and the converted model must reproduce our model's logits on a probe before anything is written. Written:
``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json`` + ``tokenizer_config.json``
(+ special tokens), and ``lineage.json`` (the raylm export's, with ``"format": "hf"`` added, written by
``train.export``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ground.formats import EOT
from train.model import GPT, NORM_EPS

# Same bound as the export's fp32 probe check: a renaming must not change the function beyond float rounding.
LOGITS_TOLERANCE = 1e-4
# GPTConfig.activation -> GPT2Config.activation_function computing the same GELU (transformers and vLLM know both).
GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


class HFExportError(RuntimeError):
    pass


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise HFExportError(
            "the Hugging Face export needs `transformers` (pip install 'raylm[hf]' or pip install transformers)"
        ) from exc
    return transformers


def check_expressible(model: GPT) -> None:
    """Raise ``HFExportError`` naming each setting GPT-2 has no equivalent for."""
    problems = []
    if model.config.arch != "gpt2":
        problems.append(f"arch: {model.config.arch}")
    if not model.config.bias:
        problems.append("bias: false (GPT-2's linear layers and LayerNorms always have biases)")
    if model.wte.weight.shape[0] != model.config.vocab_size:
        problems.append("the token embedding does not have vocab_size rows")
    if problems:
        raise HFExportError("this model cannot be exported as GPT-2: " + "; ".join(problems))


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our state dict under GPT2LMHeadModel's names and layouts (the tied lm_head is left to ``tie_weights``)."""
    ours = model.state_dict()
    out = {
        "transformer.wte.weight": ours["wte.weight"],
        "transformer.wpe.weight": ours["wpe.weight"],
        "transformer.ln_f.weight": ours["ln_f.weight"],
        "transformer.ln_f.bias": ours["ln_f.bias"],
    }
    # (ours, GPT-2's, transposed: nn.Linear (out, in) -> Conv1D (in, out))
    renames = (
        ("ln_1", "ln_1", False),
        ("ln_2", "ln_2", False),
        ("attn.qkv", "attn.c_attn", True),
        ("attn.proj", "attn.c_proj", True),
        ("mlp.fc", "mlp.c_fc", True),
        ("mlp.proj", "mlp.c_proj", True),
    )
    for i in range(model.config.n_layer):
        for src, dst, transpose in renames:
            weight = ours[f"blocks.{i}.{src}.weight"]
            out[f"transformer.h.{i}.{dst}.weight"] = weight.t().contiguous() if transpose else weight
            out[f"transformer.h.{i}.{dst}.bias"] = ours[f"blocks.{i}.{src}.bias"]
    return {name: tensor.detach().clone() for name, tensor in out.items()}


def llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our state dict under LlamaForCausalLM's names (both store nn.Linear weights (out, in): no transpose)."""
    c, ours = model.config, model.state_dict()
    out = {"model.embed_tokens.weight": ours["wte.weight"], "model.norm.weight": ours["ln_f.weight"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"]
    kv_width = c.kv_heads * c.head_dim
    for i in range(c.n_layer):
        ours_i, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = ours[ours_i + "attn.qkv.weight"].split((c.n_embd, kv_width, kv_width), dim=0)
        out |= {
            theirs + "input_layernorm.weight": ours[ours_i + "ln_1.weight"],
            theirs + "self_attn.q_proj.weight": q,
            theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": ours[ours_i + "attn.proj.weight"],
            theirs + "post_attention_layernorm.weight": ours[ours_i + "ln_2.weight"],
            theirs + "mlp.gate_proj.weight": ours[ours_i + "mlp.gate.weight"],
            theirs + "mlp.up_proj.weight": ours[ours_i + "mlp.up.weight"],
            theirs + "mlp.down_proj.weight": ours[ours_i + "mlp.proj.weight"],
        }
    return {name: tensor.detach().clone().contiguous() for name, tensor in out.items()}


def to_llama(model: GPT, eot_id: int) -> Any:
    """A ``transformers.LlamaForCausalLM`` (eval mode) computing the same function as ``model`` (``arch: llama``)."""
    transformers = _require_transformers()
    c = model.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.ffn_width,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.block_size,
        rms_norm_eps=NORM_EPS,
        rope_theta=c.rope_theta,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=c.tie_embeddings,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        architectures=["LlamaForCausalLM"],
    )
    return with_weights(transformers.LlamaForCausalLM(config), llama_state_dict(model), c.tie_embeddings)


def to_hf(model: GPT, eot_id: int) -> Any:
    """The transformers model of ``model``'s arch, computing the same function."""
    return to_llama(model, eot_id) if model.config.arch == "llama" else to_gpt2(model, eot_id)


def to_gpt2(model: GPT, eot_id: int) -> Any:
    """A ``transformers.GPT2LMHeadModel`` (eval mode) computing the same function as ``model``."""
    transformers = _require_transformers()
    check_expressible(model)
    c = model.config
    config = transformers.GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=4 * c.n_embd,
        activation_function=GPT2_ACTIVATIONS[str(c.activation)],
        layer_norm_epsilon=NORM_EPS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        architectures=["GPT2LMHeadModel"],
    )
    return with_weights(transformers.GPT2LMHeadModel(config), gpt2_state_dict(model), tied=True)


def with_weights(hf: Any, state: dict[str, torch.Tensor], tied: bool) -> Any:
    """``hf`` (eval mode) holding ``state``, every one of its tensors accounted for (a tied lm_head is the
    embedding: tied after loading)."""
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [name for name in missing if not (tied and name == "lm_head.weight")]:
        raise HFExportError(f"{type(hf).__name__} layout mismatch: missing {missing}, unexpected {unexpected}")
    if tied:
        hf.tie_weights()
    return hf.eval()


def document_start_tokenizer(tokenizer_path: Path, eot_id: int) -> Any:
    """The BPE tokenizer with a post-processor that puts the document-start token before a text.

    The model was trained on documents each preceded by EOT (docs/formats.md), so a prompt is a document start:
    with EOT before it, its first token is conditioned and scored like every other. ``add_special_tokens=True``
    (what vLLM and transformers do for a text prompt by default) applies it; ``False`` leaves the text's tokens
    alone (what lm-evaluation-harness asks for, bringing its own prefix token)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.post_processor = TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return tokenizer


@torch.no_grad()
def max_logit_difference(model: GPT, hf: Any, tokens: torch.Tensor) -> float:
    """max |ours - transformers'| over every position and vocabulary entry of ``tokens`` (B, T)."""
    ours, _ = model.eval()(tokens)
    theirs = hf(input_ids=tokens).logits
    return float((ours.float() - theirs.float()).abs().max())


def export_hf(model: GPT, tokenizer_path: Path, out: Path, probe: torch.Tensor) -> dict[str, Any]:
    """Write the Hugging Face directory for ``model`` into ``out``; ``probe`` (1, T) token ids on which the converted
    model must reproduce our logits before anything is written. Returns what the export's lineage.json adds for
    this format (``train.export`` writes it, last)."""
    transformers = _require_transformers()
    from tokenizers import Tokenizer

    eot_id = Tokenizer.from_file(str(tokenizer_path)).token_to_id(EOT)
    if eot_id is None:
        raise HFExportError(f"{tokenizer_path} has no {EOT} token")
    hf = to_hf(model, eot_id)
    diff = max_logit_difference(model, hf, probe)
    if diff > LOGITS_TOLERANCE:
        raise HFExportError(
            f"the {type(hf).__name__} conversion does not reproduce the model's logits: max |Δ| {diff:.3g}"
        )
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out), safe_serialization=True)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=document_start_tokenizer(tokenizer_path, eot_id),
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,  # byte-level BPE never produces an unknown token; GPT-2's tokenizer uses the same choice
        model_max_length=model.config.block_size,
    )
    tokenizer.save_pretrained(str(out))
    transformers.GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, max_length=model.config.block_size
    ).save_pretrained(str(out))
    return {"format": "hf", "hf_probe_max_abs_logit_diff": diff}
