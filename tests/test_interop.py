"""gptlab against Hugging Face transformers' GPT-2 (built from a config, random weights, offline)."""

import json
import logging
import os
from dataclasses import replace

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may reach the network

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from gptlab import GPTConfig, gpt_backward, gpt_forward, init_params, param_shapes
from gptlab import autograd as ag
from gptlab.interop import from_hf, from_hf_config, from_hf_directory, to_hf, to_hf_config
from gptlab.reference.torch_gpt import relative_error

TINY = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=8)


def hf_model(cfg, dtype=torch.float64, seed=0):
    """A GPT2LMHeadModel for ``cfg`` with N(0, 0.2) noise on every weight, in eval mode."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**to_hf_config(cfg))).to(dtype).eval()
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


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("gelu", ["tanh", "none"])
def test_logits_loss_and_every_grad_match_hf_float64(gelu, backend):
    cfg = GPTConfig(**TINY, gelu=gelu)
    model = hf_model(cfg)
    seq = sequence(cfg)
    hf_logits, hf_loss, hf_grads = hf_loss_and_grads(model, seq)
    params = from_hf(model.state_dict())
    assert list(params) == list(param_shapes(cfg))
    if backend == "numpy":
        params = {name: value.numpy() for name, value in params.items()}
        seq = seq.numpy()
    logits, loss, cache = gpt_forward(params, seq[:, :-1], cfg, seq[:, 1:])
    grads = gpt_backward(cache)
    assert relative_error(logits, hf_logits) < 1e-10
    assert relative_error(loss, hf_loss) < 1e-10
    want = from_hf(hf_grads)  # HF's gradient dict, renamed (the tied head appears once)
    assert list(want) == list(grads)
    for name in grads:
        assert relative_error(grads[name], want[name]) < 1e-10, name


def test_hf_labels_loss_agrees_to_float32_precision():
    """HF's ``labels=`` loss has the same shift as our targets, in float32 arithmetic."""
    cfg = GPTConfig(**TINY)
    model = hf_model(cfg)
    seq = sequence(cfg)
    with torch.no_grad():
        hf_labels_loss = model(input_ids=seq, labels=seq).loss
    params = from_hf(model.state_dict())
    _, loss, _ = gpt_forward(params, seq[:, :-1], cfg, seq[:, 1:])
    assert relative_error(loss, hf_labels_loss) < 1e-6


def test_float32_logits_match_hf():
    cfg = GPTConfig(**TINY)
    model = hf_model(cfg, dtype=torch.float32)
    seq = sequence(cfg)
    with torch.no_grad():
        hf_logits = model(input_ids=seq).logits
    logits, _, _ = gpt_forward(from_hf(model.state_dict()), seq, cfg)
    assert logits.dtype == torch.float32
    assert relative_error(logits, hf_logits) < 1e-5


def test_adamw_steps_with_manual_backward_track_hf():
    cfg = GPTConfig(**TINY)
    model = hf_model(cfg)
    ours = ag.GPT.from_params(from_hf(model.state_dict()), cfg)
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
    want = from_hf(model.state_dict())
    start = from_hf(hf_model(cfg).state_dict())
    for name, value in ours.params.items():
        assert not torch.equal(value, start[name]), f"{name} did not move"
        assert relative_error(value, want[name]) < 1e-10, name


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


def test_hf_save_pretrained_reads_back_identically(tmp_path):
    cfg = GPTConfig(**TINY, gelu="none")
    model = hf_model(cfg)
    model.save_pretrained(tmp_path)
    params, loaded_cfg = from_hf_directory(tmp_path)
    assert loaded_cfg == cfg
    want = from_hf(model.state_dict())
    assert all(np.array_equal(params[name], want[name].numpy()) for name in want)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    to_hf(params, cfg, tmp_path / "again")
    again = GPT2LMHeadModel.from_pretrained(tmp_path / "again").eval()
    seq = sequence(cfg)
    with torch.no_grad():
        assert torch.equal(again(input_ids=seq).logits, reloaded(input_ids=seq).logits)


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
