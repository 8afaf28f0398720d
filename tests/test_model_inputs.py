"""What other courses hand the model: RoPE's adjacent pairing (Meta's layout), packed documents
(a document id and a position per token), inputs with any leading dims, each checked against
the independent torch reference, against running each document alone, and by gradient checks."""

import numpy as np
import pytest
import torch
from test_model import TINY, VARIANTS, assert_all_close, random_params

from gptlab import GPTConfig, gpt_backward, gpt_forward
from gptlab.backend import convert, to_numpy
from gptlab.data_pipeline.packing import document_ids, document_positions
from gptlab.gradcheck import MODEL_EPS, check_layer
from gptlab.interop import to_hf_llama_config
from gptlab.layers.cross_entropy import cross_entropy_forward
from gptlab.model import packed_inputs, same_document_mask
from gptlab.reference.torch_gpt import reference_forward

ROPE = GPTConfig.llama(n_layer=2, n_head=4, n_embd=16, vocab_size=11, block_size=12, n_kv_head=2,
                       mlp_hidden=20)  # fmt: skip
PACKED = {
    "gpt2-learned": GPTConfig(**{**TINY, "block_size": 12}),
    "post-sinusoidal-nobias": GPTConfig(**{**TINY, "block_size": 12}, ln_order="post",
                                        position="sinusoidal", bias=False),
    "llama-gqa-rope": ROPE,
    "llama-rope-adjacent": GPTConfig.llama(**{**TINY, "block_size": 12}, n_kv_head=1,
                                           mlp_hidden=12, rope_pairing="adjacent"),
    "moe-rope": GPTConfig(**{**TINY, "block_size": 12}, mlp="moe", n_expert=3,
                          position="rope", aux_loss_weight=0.1),
}


def rows_of(*documents):
    """Documents (each a 1-D id array) side by side in one row: (idx (1, T), doc ids (1, T))."""
    idx = np.concatenate(documents)[None, :]  # (1, T)
    ids = np.concatenate([np.full(len(d), n) for n, d in enumerate(documents)])[None, :]
    return idx, ids


# --- RoPE's pairing ---------------------------------------------------------------------------


def rotate_half_order(hs: int) -> np.ndarray:
    """The coordinate order that turns an adjacent-paired head into a rotate_half one: rotate_half
    coordinate j (< hs/2) is adjacent coordinate 2j, and j + hs/2 is 2j + 1 (HF's conversion)."""
    return np.concatenate([np.arange(0, hs, 2), np.arange(1, hs, 2)])


def permute_heads(w, n_heads: int, order):
    """w (C, n_heads*hs), the columns of each head reordered by ``order`` (hs,)."""
    hs = w.shape[1] // n_heads
    columns = np.concatenate([h * hs + order for h in range(n_heads)])
    return w[:, columns]


def meta_to_rotate_half(params: dict, cfg: GPTConfig) -> dict:
    """Adjacent-pairing weights -> the rotate_half model that computes the same function."""
    order = rotate_half_order(cfg.head_size)
    heads = {"q_proj": cfg.n_head, "k_proj": cfg.kv_heads}
    return {name: permute_heads(value, heads[name.split(".")[-2]], order)
            if name.endswith(("q_proj.weight", "k_proj.weight")) else value
            for name, value in params.items()}  # fmt: skip


@pytest.mark.parametrize("backend", ("numpy", "torch"))
def test_adjacent_pairing_equals_rotate_half_with_permuted_weights(backend):
    """Meta-layout weights in an adjacent model = the permuted weights in a rotate_half model:
    the same logits and loss, and the gradients of q_proj and k_proj permuted the same way."""
    adjacent = GPTConfig(**{**ROPE.to_dict(), "rope_pairing": "adjacent"})
    params = random_params(adjacent)
    permuted = meta_to_rotate_half(params, ROPE)
    rng = np.random.default_rng(3)
    idx, targets = (convert(rng.integers(0, 11, size=(2, 9)), backend) for _ in range(2))

    def run(p, cfg):
        p = {name: convert(value, backend, dtype="float64") for name, value in p.items()}
        logits, loss, cache = gpt_forward(p, idx, cfg, targets)
        grads = {name: to_numpy(g) for name, g in gpt_backward(cache).items()}
        return to_numpy(logits), float(loss), grads

    logits_a, loss_a, grads_a = run(params, adjacent)
    logits_r, loss_r, grads_r = run(permuted, ROPE)
    np.testing.assert_allclose(logits_a, logits_r, rtol=0, atol=1e-12)
    assert abs(loss_a - loss_r) < 1e-12
    for name, g in meta_to_rotate_half(grads_a, ROPE).items():
        np.testing.assert_allclose(g, grads_r[name], rtol=0, atol=1e-12, err_msg=name)
    # and the pairing matters: the unpermuted weights in the rotate_half model differ
    assert np.abs(run(params, ROPE)[0] - logits_a).max() > 1e-3


def test_adjacent_pairing_matches_reference():
    cfg = GPTConfig(**{**ROPE.to_dict(), "rope_pairing": "adjacent"})
    params = random_params(cfg)
    idx = np.random.default_rng(4).integers(0, 11, size=(3, 10))
    got = run_ours(params, idx, cfg, targets=idx)
    assert_all_close(got, run_reference(params, idx, cfg, targets=idx), cfg, 1e-10)


def test_rope_pairing_is_validated():
    with pytest.raises(ValueError, match="rope_pairing"):
        GPTConfig.llama(n_layer=1, n_head=2, n_embd=8, rope_pairing="interleaved")


# --- packed documents ---------------------------------------------------------------------------


def run_ours(params, idx, cfg, targets=None, backend="numpy", **inputs):
    """gptlab in float64 on ``backend``: (logits, loss, grads by name)."""
    p = {name: convert(value, backend, dtype="float64") for name, value in params.items()}
    inputs = {name: convert(value, backend) for name, value in inputs.items()}
    tg = None if targets is None else convert(targets, backend)
    logits, loss, cache = gpt_forward(p, convert(idx, backend), cfg, tg, **inputs)
    return logits, loss, gpt_backward(cache) if targets is not None else None


def run_reference(params, idx, cfg, targets=None, **inputs):
    leaves = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    inputs = {name: torch.as_tensor(value) for name, value in inputs.items()}
    logits, loss = reference_forward(leaves, torch.as_tensor(idx), cfg,
                                     torch.as_tensor(targets), **inputs)  # fmt: skip
    loss.backward()
    return logits, loss, {name: leaf.grad for name, leaf in leaves.items()}


def token_losses(logits, targets):
    """-log p(target) per token (B, T) from logits (B, T, V), in NumPy."""
    logits = to_numpy(logits)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return -np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("backend", ("numpy", "torch"))
@pytest.mark.parametrize("name", PACKED)
def test_packed_documents_equal_each_document_alone(name, backend):
    """Three documents in one row give each document the logits and per-token losses it gets
    alone: no attention crosses a document, and positions restart with each."""
    cfg = PACKED[name]
    params = random_params(cfg)
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, cfg.vocab_size, size=n) for n in (5, 4, 3)]
    targets = [rng.integers(0, cfg.vocab_size, size=n) for n in (5, 4, 3)]
    idx, ids = rows_of(*docs)
    packed, _, _ = run_ours(params, idx, cfg, backend=backend, documents=ids)
    packed = to_numpy(packed)[0]  # (T, V)
    start = 0
    for doc, tg in zip(docs, targets):
        alone, loss, _ = run_ours(params, doc[None, :], cfg, tg[None, :], backend=backend)
        part = packed[start : start + len(doc)]  # (n, V)
        np.testing.assert_allclose(part, to_numpy(alone)[0], rtol=0, atol=1e-12)
        if cfg.mlp != "moe":  # a MoE loss adds the load-balancing loss of the whole batch
            assert abs(token_losses(part, tg).mean() - float(loss)) < 1e-12
        start += len(doc)
    # without the documents, the later documents see the earlier ones: the logits differ
    plain = to_numpy(run_ours(params, idx, cfg, backend=backend)[0])[0]
    assert np.abs(plain[5:] - packed[5:]).max() > 1e-3


@pytest.mark.parametrize("name", PACKED)
def test_packed_documents_match_reference(name):
    """Logits, loss and every gradient of a packed batch (two rows cut differently) against the
    torch reference differentiated by autograd."""
    cfg = PACKED[name]
    params = random_params(cfg)
    rng = np.random.default_rng(6)
    idx, targets = (rng.integers(0, cfg.vocab_size, size=(2, 11)) for _ in range(2))
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    got = run_ours(params, idx, cfg, targets, documents=ids)
    assert_all_close(got, run_reference(params, idx, cfg, targets, documents=ids), cfg, 1e-10)


@pytest.mark.parametrize("name", PACKED)
def test_explicit_positions_match_reference(name):
    """Shifted positions without documents (a window that starts at position 3), against the
    reference; and positions 0..T-1 given explicitly change nothing."""
    cfg = PACKED[name]
    params = random_params(cfg)
    rng = np.random.default_rng(7)
    idx, targets = (rng.integers(0, cfg.vocab_size, size=(2, 8)) for _ in range(2))
    shifted = np.stack([np.arange(3, 11), np.arange(1, 9)])  # (2, 8)
    got = run_ours(params, idx, cfg, targets, positions=shifted)
    assert_all_close(got, run_reference(params, idx, cfg, targets, positions=shifted), cfg, 1e-10)
    plain = run_ours(params, idx, cfg, targets)[0]
    same = run_ours(params, idx, cfg, targets, positions=np.tile(np.arange(8), (2, 1)))[0]
    np.testing.assert_array_equal(plain, same)


def packed_loss(params, idx, targets, documents, *, cfg):
    """The whole GPT on packed documents as one layer: (params, idx, targets, documents) ->
    (loss, cache)."""
    _, loss, cache = gpt_forward(params, idx, cfg, targets, documents=documents)
    return loss, cache


def packed_loss_backward(dloss, cache):
    return ({name: dloss * g for name, g in gpt_backward(cache).items()},)


@pytest.mark.parametrize("oracle", ("finite_differences", "autograd"))
@pytest.mark.parametrize("name", ("gpt2-learned", "llama-rope-adjacent", "moe-rope"))
def test_packed_documents_gradcheck(name, oracle):
    cfg = PACKED[name]
    params = random_params(cfg)
    rng = np.random.default_rng(8)
    idx, targets = (rng.integers(0, cfg.vocab_size, size=(2, 7)) for _ in range(2))
    ids = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])
    result = check_layer(packed_loss, packed_loss_backward, params, idx, targets, ids,
                         oracle=oracle, dout=1.0, eps=MODEL_EPS, richardson=True,
                         max_elements=12, cfg=cfg)  # fmt: skip
    result.assert_ok()


def test_recompute_and_dropout_keep_the_documents():
    """Activation recomputation runs the blocks again with the same mask and positions."""
    cfg = PACKED["llama-gqa-rope"]
    params = random_params(cfg)
    idx, ids = rows_of(np.arange(5) % 11, np.arange(6) % 11)
    _, loss, cache = gpt_forward(params, idx, cfg, idx, documents=ids)
    _, loss_r, cache_r = gpt_forward(params, idx, cfg, idx, documents=ids, recompute=True)
    for name, g in gpt_backward(cache).items():
        np.testing.assert_allclose(gpt_backward(cache_r)[name], g, rtol=0, atol=1e-14)


def test_packing_gives_the_models_inputs():
    """Chapter 20's rows: document_ids and document_positions are what gpt_forward takes, and
    documents alone imply those positions and the block-diagonal causal mask."""
    eot = 10
    rows = np.array([[1, 2, eot, 3, 4, 5, eot, 6], [eot, 7, 8, eot, eot, 1, 2, 3]])
    ids = document_ids(rows, eot)
    positions = document_positions(rows, eot)
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 0, 0, 1, 2]])
    cfg = PACKED["gpt2-learned"]
    mask, implied = packed_inputs(rows, cfg, documents=ids)
    np.testing.assert_array_equal(implied, positions)
    np.testing.assert_array_equal(mask, same_document_mask(ids))
    params = random_params(cfg)
    a = gpt_forward(params, rows, cfg, documents=ids)[0]
    b = gpt_forward(params, rows, cfg, documents=ids, positions=positions)[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("inputs, message", [
    (dict(documents=np.zeros((2, 5))), "documents"),
    (dict(documents=np.zeros((2, 4), dtype=np.int64)), "documents has shape"),
    (dict(positions=np.zeros((1, 5), dtype=np.int64)), "positions has shape"),
    (dict(positions=np.full((2, 5), -1)), r"positions must lie in \[0, block_size"),
    (dict(positions=np.full((2, 5), 12)), r"positions must lie in \[0, block_size=12\)"),
])  # fmt: skip
def test_packed_inputs_are_checked(inputs, message):
    cfg = PACKED["gpt2-learned"]
    params = random_params(cfg)
    with pytest.raises((TypeError, ValueError), match=message):
        gpt_forward(params, np.zeros((2, 5), dtype=np.int64), cfg, **inputs)


def test_variants_accept_documents_on_every_config():
    """Every variant of test_model runs packed documents like each document alone (the second
    document). Not with an expert capacity: the batch's tokens share each expert's capacity, so
    a token of one document can push a token of another out of its expert."""
    for name, cfg in VARIANTS.items():
        if cfg.capacity_factor is not None:
            continue
        params = random_params(cfg)
        idx, ids = rows_of(np.arange(4) % 11, np.arange(3, 7) % 11)
        packed = to_numpy(gpt_forward(params, idx, cfg, documents=ids)[0])
        alone = to_numpy(gpt_forward(params, idx[:, 4:], cfg)[0])
        np.testing.assert_allclose(packed[:, 4:], alone, rtol=0, atol=1e-12, err_msg=name)


def test_cross_entropy_of_the_packed_batch_is_the_token_mean():
    """The packed loss is the mean over all tokens of the per-document token losses."""
    cfg = PACKED["gpt2-learned"]
    params = random_params(cfg)
    idx, ids = rows_of(np.arange(5) % 11, np.arange(2, 9) % 11)
    targets = (idx + 1) % 11
    logits, loss, _ = gpt_forward(params, idx, cfg, targets, documents=ids)
    assert abs(float(loss) - float(cross_entropy_forward(logits, targets)[0])) < 1e-14
    assert abs(float(loss) - token_losses(logits, targets).mean()) < 1e-12


def test_hugging_face_llama_refuses_adjacent_pairing():
    """Hugging Face's LLaMA pairs rotate_half: an adjacent model is not written as one."""
    assert to_hf_llama_config(ROPE)["num_key_value_heads"] == 2
    with pytest.raises(ValueError, match="cannot express rope_pairing='adjacent'"):
        to_hf_llama_config(GPTConfig(**{**ROPE.to_dict(), "rope_pairing": "adjacent"}))


@pytest.mark.parametrize("name", PACKED)
def test_packed_documents_on_every_backend(backend, name):
    """Logits and gradients of a packed row on NumPy, torch and array_api_strict on a second
    device are those of NumPy."""
    cfg = PACKED[name]
    params = random_params(cfg)
    idx, ids = rows_of(np.arange(5) % 11, np.arange(4) % 11)
    logits, _, cache = gpt_forward(backend.convert(params), backend.convert(idx), cfg,
                                   backend.convert(idx), documents=backend.convert(ids))
    want_logits, _, want_cache = gpt_forward(params, idx, cfg, idx, documents=ids)
    np.testing.assert_allclose(to_numpy(logits), want_logits, rtol=0, atol=1e-12)
    want = gpt_backward(want_cache)
    for name, g in gpt_backward(cache).items():
        np.testing.assert_allclose(to_numpy(g), want[name], rtol=0, atol=1e-12, err_msg=name)
