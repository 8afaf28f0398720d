"""The static decoder: generate's ids in steps of one fixed shape, nothing read back to the host
inside a step (so a CUDA graph can replay it), and clear refusals."""

import pytest
import torch

from conftest import requires_cuda
from gptlab import GPTConfig
from gptlab.model import init_params
from gptlab.cli import main
from gptlab.training.decode import HostReads, StaticDecoder
from gptlab.training.sample import generate

VARIANTS = {
    "gpt2": {},
    "gpt2 with biases": {"bias": True},
    "sinusoidal": {"position": "sinusoidal"},
    "post-LN": {"ln_order": "post"},
    "rmsnorm + swiglu": {"norm": "rmsnorm", "mlp": "swiglu"},
}
SAMPLING = {
    "greedy": {"greedy": True},
    "temperature 0": {"temperature": 0.0},
    "top-k": {"temperature": 0.9, "top_k": 10, "seed": 3},
    "top-p": {"temperature": 1.2, "top_p": 0.8, "seed": 5},
}


def tiny(dtype="float64", device="cpu", **fields):
    cfg = GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=16, **fields)
    return init_params(cfg, seed=1, backend="torch", dtype=dtype, device=device), cfg


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS)
@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING)
def test_same_ids_as_generate(fields, sampling):
    params, cfg = tiny(**fields)
    decoder = StaticDecoder(params, cfg)
    for prompt in ([1, 2, 3], [7]):  # the decoder is reused: the second text starts afresh
        expected = generate(params, cfg, prompt, 20, **sampling)
        assert decoder.generate(prompt, 20, **sampling) == expected


def test_fills_the_whole_context():
    params, cfg = tiny()
    prompt = list(range(10))
    n = cfg.block_size - len(prompt) + 1  # the last new token is never fed: T_max positions
    assert StaticDecoder(params, cfg).generate(prompt, n, greedy=True) == generate(
        params, cfg, prompt, n, greedy=True)


@pytest.mark.parametrize("check_every", [1, 4, 32])
def test_stop_token_ends_the_text_and_is_kept(check_every):
    params, cfg = tiny()
    sampling = {"temperature": 1.0, "seed": 11}
    free = generate(params, cfg, [1, 2], 20, **sampling)
    stop = free[2 + 5]  # the sixth new token
    expected = generate(params, cfg, [1, 2], 20, stop_token=stop, **sampling)
    assert expected[-1] == stop and len(expected) <= 2 + 6
    decoder = StaticDecoder(params, cfg)
    assert decoder.generate([1, 2], 20, stop_token=stop, check_every=check_every,
                            **sampling) == expected  # fmt: skip


def test_on_token_sees_every_new_token_in_order():
    params, cfg = tiny()
    seen = []
    ids = StaticDecoder(params, cfg).generate([4, 5], 9, greedy=True, on_token=seen.append)
    assert seen == ids[2:] and len(seen) == 9


def test_max_new_tokens_zero_returns_the_prompt():
    params, cfg = tiny()
    assert StaticDecoder(params, cfg).generate([3, 1, 4], 0) == [3, 1, 4]


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS)
def test_a_step_reads_nothing_back_and_keeps_its_shapes(fields):
    params, cfg = tiny(dtype="float32", **fields)
    decoder = StaticDecoder(params, cfg)
    decoder.generate([1, 2], 3, greedy=True)  # allocates the step's memory
    decoder.pos.zero_()
    shapes = set()
    with HostReads() as reads:
        for token in (5, 6, 7):
            decoder.token.fill_(token)
            shapes.add(tuple(decoder.step().shape))
    assert reads.ops == []
    assert shapes == {(1, cfg.vocab_size)} and int(decoder.pos) == 3


def test_the_host_read_detector_detects():
    with HostReads() as reads:
        float(torch.ones(2).sum())
        torch.arange(4)[torch.arange(4) > 1]  # a shape that depends on the values
    assert reads.ops[0] == "_local_scalar_dense" and len(reads.ops) == 2


def test_generate_reads_every_token_back():
    params, cfg = tiny(dtype="float32")
    with HostReads() as reads:
        generate(params, cfg, [1, 2], 5, greedy=True)
    assert reads.ops.count("_local_scalar_dense") >= 5


def test_positions_past_the_fed_one_do_not_matter():
    """The hidden cache entries get weight exactly 0: filling them with junk changes nothing."""
    params, cfg = tiny()
    decoder = StaticDecoder(params, cfg)
    decoder.generate([1], 1)
    for junk in (0.0, 1e3):
        decoder.k_cache.fill_(junk)
        decoder.v_cache.fill_(junk)
        decoder.pos.zero_()
        decoder.token.fill_(9)
        logits = decoder.step().clone()
        if junk == 0.0:
            clean = logits
    assert torch.equal(logits, clean)


BAD = [
    ({"position": "rope"}, {}, ValueError, "position='rope'"),
    ({"n_kv_head": 1}, {}, ValueError, "n_kv_head=1"),
    ({"mlp": "moe", "n_expert": 2}, {}, ValueError, "mlp='moe'"),
    ({}, {"max_len": 33}, ValueError, "max_len must be an integer in \\[1, block_size=32\\]"),
    ({}, {"max_len": 0}, ValueError, "max_len"),
    ({}, {"cuda_graph": True}, ValueError, "cuda_graph=True needs the parameters on a CUDA"),
]


@pytest.mark.parametrize("fields, options, error, match", BAD)
def test_refusals_name_the_problem(fields, options, error, match):
    params, cfg = tiny(**fields)
    with pytest.raises(error, match=match):
        StaticDecoder(params, cfg, **options)


def test_numpy_params_are_refused():
    cfg = GPTConfig(vocab_size=50, block_size=32, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(TypeError, match="torch tensors, got numpy.ndarray; use generate"):
        StaticDecoder(init_params(cfg, seed=0), cfg)


@pytest.mark.parametrize("prompt, n, kwargs, match", [
    (list(range(30)), 4, {}, "need 33 cached positions, more than the decoder's 32"),
    ([1, 2], 4, {"check_every": 0}, "check_every must be a positive integer"),
    ([1, 99], 4, {}, "prompt_ids"),
    ([1, 2], -1, {}, "max_new_tokens must be a non-negative integer"),
    ([1, 2], 4, {"top_p": 1.5}, "top_p must be in"),
])  # fmt: skip
def test_bad_arguments_are_refused_before_any_step(prompt, n, kwargs, match):
    params, cfg = tiny()
    decoder = StaticDecoder(params, cfg)
    with pytest.raises(ValueError, match=match):
        decoder.generate(prompt, n, **kwargs)
    assert decoder.token is None  # nothing was allocated or run


def test_the_command_line_refuses_cuda_graph_off_cuda_before_loading(tmp_path, capsys):
    missing = str(tmp_path / "no-run-here")  # the refusal comes before the checkpoint is read
    for device in ([], ["--device", "cpu"]):
        assert main(["sample", "--checkpoint", missing, "--cuda-graph", *device]) == 2
        assert "--cuda-graph replays the decode step on a GPU" in capsys.readouterr().err


def test_check_fits_counts_the_positions_a_text_needs():
    params, cfg = tiny()
    decoder = StaticDecoder(params, cfg, max_len=8)
    decoder.check_fits(3, 6)  # 8 positions: the last new token is never fed
    with pytest.raises(ValueError, match="need 9 cached positions, more than the decoder's 8"):
        decoder.check_fits(3, 7)


@requires_cuda
@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING)
def test_cuda_graph_gives_generates_ids(sampling):
    params, cfg = tiny(device="cuda")  # float64: no near-ties that round-off could flip
    decoder = StaticDecoder(params, cfg)
    assert decoder.cuda_graph
    for prompt in ([1, 2, 3], [7]):
        expected = generate(params, cfg, prompt, 20, **sampling)
        assert decoder.generate(prompt, 20, **sampling) == expected
    assert decoder.graph is not None
