"""gptlab against Hugging Face transformers' GPT-2 and LLaMA (built from a config, random weights,
offline)."""

import json
import logging
import os
from dataclasses import replace

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may reach the network

import numpy as np
import pytest
import torch
from bounds import assert_relative, model_roundoff, roundoff
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from gptlab import GPTConfig, gpt_backward, gpt_forward, init_params, param_shapes
from gptlab import autograd as ag
from gptlab.interop import (
    from_hf,
    from_hf_config,
    from_hf_directory,
    from_hf_llama,
    from_hf_llama_config,
    to_hf,
    to_hf_config,
    to_hf_llama,
    to_hf_llama_config,
)
from gptlab.reference.torch_gpt import relative_error

TINY = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=8)


def hf_model(cfg, dtype=torch.float64, seed=0, llama=False):
    """A GPT2LMHeadModel (or LlamaForCausalLM) for ``cfg`` with N(0, 0.2) noise on every weight,
    in eval mode."""
    torch.manual_seed(seed)
    if llama:
        model = LlamaForCausalLM(LlamaConfig(**to_hf_llama_config(cfg)))
    else:
        model = GPT2LMHeadModel(GPT2Config(**to_hf_config(cfg)))
    model = model.to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def sequence(cfg, B=3, seed=0):
    """(B, block_size) token ids; idx = seq[:, :-1] and targets = seq[:, 1:] (next tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g)


def hf_loss(model, seq):
    """(logits (B, T-1, V), loss) scored as our targets: logits[:, t] predicts seq[:, t + 1].

    HF's own ``labels=seq`` does the same shift but casts the logits to float32 first, so in
    float64 the loss is computed here from HF's logits.
    """
    logits = model(input_ids=seq).logits[:, :-1]  # (B, T-1, V)
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))


def hf_loss_and_grads(model, seq):
    model.zero_grad()
    logits, loss = hf_loss(model, seq)
    loss.backward()
    return logits, loss, {n: p.grad for n, p in model.named_parameters()}


def assert_matches_hf(model, cfg, read, backend):
    """Logits, loss and every gradient of gptlab on ``backend`` equal the HF model's, with
    ``read`` (from_hf or from_hf_llama) renaming HF's parameters and gradients."""
    seq = sequence(cfg)
    hf_logits, hf_loss, hf_grads = hf_loss_and_grads(model, seq)
    params = read(model.state_dict(), cfg)
    assert list(params) == list(param_shapes(cfg))
    if backend == "numpy":
        params = {name: value.numpy() for name, value in params.items()}
        seq = seq.numpy()
    logits, loss, cache = gpt_forward(params, seq[:, :-1], cfg, seq[:, 1:])
    grads = gpt_backward(cache)
    assert relative_error(logits, hf_logits) < 1e-10
    assert relative_error(loss, hf_loss) < 1e-10
    want = read(hf_grads, cfg)  # HF's gradient dict, renamed (the tied head appears once)
    assert list(want) == list(grads)
    for name in grads:
        assert relative_error(grads[name], want[name]) < 1e-10, name


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("gelu", ["tanh", "none"])
def test_logits_loss_and_every_grad_match_hf_float64(gelu, backend):
    cfg = GPTConfig(**TINY, gelu=gelu)
    assert_matches_hf(hf_model(cfg), cfg, lambda state, _: from_hf(state), backend)


@pytest.mark.roundoff
def test_hf_labels_loss_agrees_to_float32_precision():
    """HF's ``labels=`` loss has the same shift as our targets, in float32 arithmetic."""
    cfg = GPTConfig(**TINY)
    model = hf_model(cfg)
    seq = sequence(cfg)
    with torch.no_grad():
        hf_labels_loss = model(input_ids=seq, labels=seq).loss
    params = from_hf(model.state_dict())
    _, loss, _ = gpt_forward(params, seq[:, :-1], cfg, seq[:, 1:])
    bound = roundoff("float32", cfg.vocab_size, why="HF's float32 log-softmax over V logits")
    assert_relative(loss, hf_labels_loss, bound, "HF labels loss (float32) vs ours")


@pytest.mark.roundoff
def test_float32_logits_match_hf():
    cfg = GPTConfig(**TINY)
    model = hf_model(cfg, dtype=torch.float32)
    seq = sequence(cfg)
    with torch.no_grad():
        hf_logits = model(input_ids=seq).logits
    logits, _, _ = gpt_forward(from_hf(model.state_dict()), seq, cfg)
    assert logits.dtype == torch.float32
    assert_relative(logits, hf_logits, model_roundoff(cfg, 3, cfg.block_size),
                    "float32 logits, ours vs HF")


def from_pretrained_logits(directory, seq):
    """GPT2LMHeadModel.from_pretrained(directory) -> (model, loading info, its logits on seq)."""
    model, info = GPT2LMHeadModel.from_pretrained(directory, output_loading_info=True)
    with torch.no_grad():
        logits = model.eval()(input_ids=seq).logits
    return model, info, logits


def test_to_hf_round_trip_through_from_pretrained(tmp_path, recwarn, caplog, monkeypatch):
    cfg = GPTConfig(**TINY, dropout=0.1)
    params = {n: v + 0.1 for n, v in init_params(cfg, seed=1, dtype="float64").items()}
    assert to_hf(params, cfg, tmp_path / "ckpt") == tmp_path / "ckpt"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    # transformers logs its warnings to a logger that does not propagate: let caplog see them
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    seq = sequence(cfg)
    model, info, hf_logits = from_pretrained_logits(tmp_path / "ckpt", seq)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}  # fmt: skip
    assert not [w for w in recwarn if "transformers" in str(w.filename)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert model.dtype == torch.float64 and model.lm_head.weight is model.transformer.wte.weight
    logits, _, _ = gpt_forward(params, seq.numpy(), cfg)
    assert relative_error(logits, hf_logits) < 1e-10
    loaded, loaded_cfg = from_hf_directory(tmp_path / "ckpt")
    assert loaded_cfg == cfg
    assert all(np.array_equal(loaded[name], params[name]) for name in params)
    assert list(loaded) == list(params)


def test_a_model_without_biases_exports_with_zero_biases(tmp_path):
    """GPT-2 always has biases: a bias=False model (nanoGPT's option) is written with zeros,
    which HF loads without complaint and which compute the same logits."""
    cfg = GPTConfig(**TINY, bias=False, gelu="none")
    params = {n: v + 0.1 for n, v in init_params(cfg, seed=2, dtype="float64").items()}
    to_hf(params, cfg, tmp_path / "ckpt")
    seq = sequence(cfg)
    _, info, hf_logits = from_pretrained_logits(tmp_path / "ckpt", seq)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    logits, _, _ = gpt_forward(params, seq.numpy(), cfg)
    assert relative_error(logits, hf_logits) < 1e-10
    loaded, loaded_cfg = from_hf_directory(tmp_path / "ckpt")
    assert loaded_cfg == replace(cfg, bias=True)
    biases = [name for name in loaded if name.endswith(".bias")]
    assert len(biases) == 6 * cfg.n_layer + 1 and not any(loaded[name].any() for name in biases)
    assert all(np.array_equal(loaded[name], params[name]) for name in params)


def test_from_hf_accepts_gpt2model_names_and_drops_buffers():
    cfg = GPTConfig(**TINY)
    model = hf_model(cfg)
    base = from_hf(model.transformer.state_dict())
    full = from_hf(model.state_dict())
    assert list(base) == list(full) == list(param_shapes(cfg))
    buffers = {"h.0.attn.bias": torch.ones(1, 1, 8, 8), "h.0.attn.masked_bias": torch.tensor(-1e4)}
    assert list(from_hf({**model.transformer.state_dict(), **buffers})) == list(full)


def test_from_hf_rejects_unknown_keys_and_an_untied_head():
    state = hf_model(GPTConfig(**TINY)).state_dict()
    with pytest.raises(ValueError, match="unknown GPT-2 parameter 'transformer.h.0.attn.q_attn.weight'"):
        from_hf({**state, "transformer.h.0.attn.q_attn.weight": state["lm_head.weight"]})
    with pytest.raises(ValueError, match="untied"):
        from_hf({**state, "lm_head.weight": state["lm_head.weight"] + 1.0})
    numpy_state = {name: value.numpy() for name, value in state.items()}
    assert list(from_hf(numpy_state)) == list(from_hf(state))


def test_hf_config_fields_and_round_trip():
    cfg = GPTConfig(**TINY, gelu="none", dropout=0.1, layer_norm_epsilon=1e-6)
    config = to_hf_config(cfg)
    assert config["n_positions"] == config["n_ctx"] == 8
    assert config["activation_function"] == "gelu"
    assert to_hf_config(GPTConfig(**TINY))["activation_function"] == "gelu_new"
    assert (config["resid_pdrop"], config["embd_pdrop"], config["attn_pdrop"]) == (0.1, 0.1, 0.0)
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["GPT2LMHeadModel"]
    hf = GPT2Config(**config)
    assert (hf.n_layer, hf.n_head, hf.n_embd, hf.vocab_size) == (2, 2, 16, 50)
    assert from_hf_config(config) == cfg


@pytest.mark.parametrize("change, message", [({"ln_order": "post"}, "pre-LN"),
                                             ({"position": "sinusoidal"}, "learned positions")])
def test_configs_hf_cannot_express(change, message, tmp_path):
    cfg = GPTConfig(**TINY, **change)
    with pytest.raises(ValueError, match=message):
        to_hf_config(cfg)
    with pytest.raises(ValueError, match=message):
        to_hf(init_params(cfg), cfg, tmp_path)
    assert not list(tmp_path.iterdir())


def test_from_hf_config_rejects_what_gptlab_cannot_express():
    config = to_hf_config(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        from_hf_config({**config, "model_type": "llama"})
    with pytest.raises(ValueError, match=r"lacks \['n_head'\]"):
        from_hf_config({k: v for k, v in config.items() if k != "n_head"})
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        from_hf_config({**config, "tie_word_embeddings": False})
    with pytest.raises(ValueError, match="'relu' is not one of"):
        from_hf_config({**config, "activation_function": "relu"})


def test_from_hf_directory_errors(tmp_path):
    cfg = GPTConfig(**TINY)
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        from_hf_directory(tmp_path / "nowhere")
    to_hf(init_params(cfg), cfg, tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        from_hf_directory(tmp_path)
    torch.save({"wte.weight": torch.zeros(3)}, weights)  # a pickle under the wrong name
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        from_hf_directory(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors not found"):
        from_hf_directory(tmp_path)
    one_layer = GPTConfig(**{**TINY, "n_layer": 1})
    to_hf(init_params(one_layer), one_layer, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg)))  # claims two layers
    with pytest.raises(ValueError, match=r"missing \['h.1"):
        from_hf_directory(tmp_path)


# --- LLaMA: LlamaForCausalLM built from a LlamaConfig (random weights, offline) ---------------

LLAMA_TINY = dict(n_layer=2, n_head=4, n_embd=16, vocab_size=50, block_size=8)
LLAMAS = {
    "gqa": GPTConfig.llama(**LLAMA_TINY, n_kv_head=2, mlp_hidden=24, rope_base=500.0),
    "mqa-tied": GPTConfig.llama(**LLAMA_TINY, n_kv_head=1, mlp_hidden=24, tie_embeddings=True),
    "mha-eps": GPTConfig.llama(**LLAMA_TINY, mlp_hidden=20, layer_norm_epsilon=1e-5),
}


@pytest.fixture
def float64_llama(monkeypatch):
    """Hugging Face computes RMSNorm and the rotary angles in float32 whatever the model's dtype
    (``hidden_states.to(torch.float32)``, ``position_ids.float()``). These are its two forwards
    without that cast, so that a float64 model is float64 throughout."""

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        dim, base = self.config.head_dim, self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq  # (B, T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hs), rotate_half's layout
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary)


def hf_llama(cfg, dtype=torch.float64, seed=0):
    return hf_model(cfg, dtype, seed, llama=True)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", LLAMAS)
def test_llama_logits_loss_and_every_grad_match_hf_float64(float64_llama, name, backend):
    """HF's gradients come back renamed and transposed into our layout, by from_hf_llama."""
    cfg = LLAMAS[name]
    assert_matches_hf(hf_llama(cfg), cfg, from_hf_llama, backend)


@pytest.mark.roundoff
def test_llama_float32_logits_match_hf_as_it_is():
    """Without the float64 patch: HF's own float32 RMSNorm and rotary angles."""
    cfg = LLAMAS["gqa"]
    model = hf_llama(cfg, dtype=torch.float32)
    seq = sequence(cfg)
    with torch.no_grad():
        hf_logits = model(input_ids=seq).logits
    logits, _, _ = gpt_forward(from_hf_llama(model.state_dict(), cfg), seq, cfg)
    assert logits.dtype == torch.float32
    assert_relative(logits, hf_logits, model_roundoff(cfg, 3, cfg.block_size),
                    "float32 LLaMA logits, ours vs HF")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_adamw_steps_with_manual_backward_track_hf(float64_llama, arch):
    if arch == "gpt2":
        cfg, make, read = GPTConfig(**TINY), hf_model, lambda state, _: from_hf(state)
    else:
        cfg, make, read = LLAMAS["gqa"], hf_llama, from_hf_llama
    model = make(cfg)
    ours = ag.GPT.from_params(read(model.state_dict(), cfg), cfg)
    seq = sequence(cfg)
    opt_hf = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for opt in (opt_hf, opt_ours):
            opt.zero_grad()
        hf_loss(model, seq)[1].backward()
        ours(seq[:, :-1], seq[:, 1:])[1].backward()
        opt_hf.step()
        opt_ours.step()
    want = read(model.state_dict(), cfg)
    start = read(make(cfg).state_dict(), cfg)
    for name, value in ours.params.items():
        assert not torch.equal(value, start[name]), f"{name} did not move"
        assert relative_error(value, want[name]) < 1e-10, name


@pytest.mark.parametrize("name", LLAMAS)
def test_to_hf_llama_round_trip_through_from_pretrained(float64_llama, name, tmp_path, recwarn,
                                                       caplog, monkeypatch):  # fmt: skip
    cfg = LLAMAS[name]
    params = {n: v + 0.1 for n, v in init_params(cfg, seed=1, dtype="float64").items()}
    assert to_hf_llama(params, cfg, tmp_path / "ckpt") == tmp_path / "ckpt"
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    model, info = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}  # fmt: skip
    assert not [w for w in recwarn if "transformers" in str(w.filename)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert model.dtype == torch.float64
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_embeddings
    seq = sequence(cfg)
    with torch.no_grad():
        hf_logits = model.eval()(input_ids=seq).logits
    logits, _, _ = gpt_forward(params, seq.numpy(), cfg)
    assert relative_error(logits, hf_logits) < 1e-10
    loaded, loaded_cfg = from_hf_directory(tmp_path / "ckpt")
    assert loaded_cfg == cfg
    assert list(loaded) == list(params)
    assert all(np.array_equal(loaded[n], params[n]) and loaded[n].flags.c_contiguous
               for n in params)  # fmt: skip


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_save_pretrained_reads_back_identically(tmp_path, arch):
    """Hugging Face's own save_pretrained, read by from_hf_directory (either model type) and
    written again by to_hf or to_hf_llama: the same logits, bit for bit."""
    if arch == "gpt2":
        cfg, model_class, write = GPTConfig(**TINY, gelu="none"), GPT2LMHeadModel, to_hf
        model = hf_model(cfg)
        want = from_hf(model.state_dict())
    else:
        cfg, model_class, write = LLAMAS["mqa-tied"], LlamaForCausalLM, to_hf_llama
        model = hf_llama(cfg)
        want = from_hf_llama(model.state_dict(), cfg)
    model.save_pretrained(tmp_path)
    params, loaded_cfg = from_hf_directory(tmp_path)
    assert loaded_cfg == cfg
    assert all(np.array_equal(params[name], want[name].numpy()) for name in want)
    reloaded = model_class.from_pretrained(tmp_path).eval()
    write(params, cfg, tmp_path / "again")
    again = model_class.from_pretrained(tmp_path / "again").eval()
    seq = sequence(cfg)
    with torch.no_grad():
        assert torch.equal(again(input_ids=seq).logits, reloaded(input_ids=seq).logits)


def test_from_hf_llama_names_heads_and_errors():
    cfg = LLAMAS["gqa"]
    state = hf_llama(cfg).state_dict()
    base = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        from_hf_llama(base, cfg)  # LlamaModel's names, but this config has its own head
    tied = LLAMAS["mqa-tied"]
    tied_state = hf_llama(tied).state_dict()
    base = {k.removeprefix("model."): v for k, v in tied_state.items() if k != "lm_head.weight"}
    assert list(from_hf_llama(base, tied)) == list(from_hf_llama(tied_state, tied))
    with pytest.raises(ValueError, match="ties the head"):
        from_hf_llama({**tied_state, "lm_head.weight": tied_state["lm_head.weight"] + 1.0}, tied)
    with pytest.raises(ValueError, match="unexpected LLaMA parameter 'model.layers.0.mlp.w1'"):
        from_hf_llama({**state, "model.layers.0.mlp.w1": state["lm_head.weight"]}, cfg)
    with pytest.raises(ValueError, match="has norm='rmsnorm' only"):
        from_hf_llama(state, GPTConfig(**TINY))
    params = from_hf_llama(state, cfg)
    q = params["h.1.attn.k_proj.weight"]
    assert tuple(q.shape) == (16, 8)
    assert torch.equal(q, state["model.layers.1.self_attn.k_proj.weight"].T)


def test_llama_config_fields_and_round_trip():
    cfg = LLAMAS["gqa"]
    config = to_hf_llama_config(cfg)
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (
        2, 4, 24)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}
    assert config["tie_word_embeddings"] is False and config["rms_norm_eps"] == 1e-6
    hf = LlamaConfig(**config)
    assert (hf.num_hidden_layers, hf.hidden_size, hf.vocab_size) == (2, 16, 50)
    assert from_hf_llama_config(config) == cfg
    preset = GPTConfig.llama(n_layer=2, n_head=4, n_embd=384, vocab_size=50, block_size=8)
    assert to_hf_llama_config(preset)["intermediate_size"] == 1024  # LLaMA's 8/3 C, rounded
    assert from_hf_llama_config(to_hf_llama_config(preset)) == preset  # mlp_hidden None again
    llama2 = {k: v for k, v in config.items() if k != "rope_parameters"}  # Llama 2's layout
    assert from_hf_llama_config({**llama2, "rope_scaling": None}) == cfg


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 8}, "head_dim"),
    ({"model_type": "mistral"}, "model_type 'llama'"),
])  # fmt: skip
def test_from_hf_llama_config_rejects_what_gptlab_cannot_express(change, message):
    with pytest.raises(ValueError, match=message):
        from_hf_llama_config({**to_hf_llama_config(LLAMAS["gqa"]), **change})


@pytest.mark.parametrize("cfg, message", [
    (GPTConfig.llama(**LLAMA_TINY, ln_order="post"), "ln_order='pre' only"),
    (GPTConfig.llama(**LLAMA_TINY, mlp="gelu", bias=True), "mlp='swiglu' only"),
    (GPTConfig.llama(**LLAMA_TINY, position="learned"), "position='rope' only"),
])  # fmt: skip
def test_configs_llama_cannot_express(cfg, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        to_hf_llama(init_params(cfg), cfg, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("change, message", [
    ({"norm": "rmsnorm"}, "norm='layernorm' only"),
    ({"n_kv_head": 1}, "n_kv_head=None only"),
    ({"tie_embeddings": False}, "tie_embeddings=True only"),
])  # fmt: skip
def test_configs_gpt2_cannot_express(change, message):
    with pytest.raises(ValueError, match=message):
        to_hf_config(GPTConfig(**TINY, **change))


def test_gpt2_mlp_width_round_trips_as_n_inner():
    cfg = GPTConfig(**TINY, mlp_hidden=24)
    config = to_hf_config(cfg)
    assert config["n_inner"] == 24 and from_hf_config(config) == cfg
    assert from_hf_config({**config, "n_inner": 64}) == GPTConfig(**TINY)  # 4C: the default
    model = GPT2LMHeadModel(GPT2Config(**config)).to(torch.float64).eval()
    seq = sequence(cfg)
    with torch.no_grad():
        hf_logits = model(input_ids=seq).logits
    assert relative_error(gpt_forward(from_hf(model.state_dict()), seq, cfg)[0], hf_logits) < 1e-10
