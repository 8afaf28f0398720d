"""gptlab.show_source: the chapters' listings of the package's own code."""

import inspect

import pytest

from gptlab import show_source
from gptlab.layers.layernorm import layernorm_forward
from gptlab.training.optim import AdamW
from gptlab.course.source import Source


def test_listing_is_the_current_source_without_input_checks():
    listing = show_source(layernorm_forward)
    full = inspect.getsource(layernorm_forward)
    assert listing.code.startswith("def layernorm_forward(x, w, b=None, *, eps: float = 1e-5):")
    assert "require_" not in listing.code and "require_float" in full
    for line in listing.code.splitlines():  # nothing but the input checks is left out
        assert line in full
    assert "xhat = xc * rstd  # (..., C)" in listing.code
    assert listing.caption == "`layernorm_forward` in `gptlab/layers/layernorm.py` (input checks left out)"


def test_checks_true_shows_every_line():
    listing = show_source(layernorm_forward, checks=True)
    assert listing.code == inspect.getsource(layernorm_forward).rstrip("\n")
    assert "left out" not in listing.caption


def test_guards_that_raise_input_errors_are_checks_others_are_not():
    attention = show_source("gptlab.layers.attention.attention_forward")
    assert "raise ValueError" not in attention.code and "if " not in attention.code
    train_loop = show_source("gptlab.training.train._train", start_at="while step < cfg.max_iters",
                             end_before="return TrainResult")
    assert "raise TrainingDiverged" in train_loop.code  # a run-time guard, not an input check
    assert train_loop.code.startswith("while step < cfg.max_iters:")  # dedented excerpt
    assert train_loop.caption.endswith("(excerpt)")


def test_methods_by_object_and_dotted_name_agree():
    by_object = show_source(AdamW.step)
    assert by_object == show_source("gptlab.training.optim.AdamW.step")
    assert by_object.code.startswith("def step(self")  # dedented out of the class
    assert by_object.caption.startswith("`AdamW.step` in `gptlab/training/optim.py`")


def test_renders_as_markdown_code_block_and_plain_text():
    listing = Source("x = `a` + ```b```", "`f` in `gptlab/f.py`")
    markdown = listing._repr_markdown_()
    assert markdown.startswith("`f` in `gptlab/f.py`\n\n````python\n")  # fence longer than ```
    assert markdown.rstrip().endswith("````")
    assert repr(listing) == "f in gptlab/f.py\n\nx = `a` + ```b```"


@pytest.mark.parametrize("target, message", [
    ("gptlab.no_such_module.f", "has no attribute"),
    ("no_such_package.f", "cannot import"),
])
def test_bad_targets_name_the_problem(target, message):
    with pytest.raises((ValueError, AttributeError), match=message):
        show_source(target)


def test_missing_excerpt_marker_is_an_error():
    with pytest.raises(ValueError, match="no line of layernorm_forward contains 'nonsense'"):
        show_source(layernorm_forward, start_at="nonsense")
    with pytest.raises(TypeError, match="cannot show the source"):
        show_source(len)


def test_the_formatters_directives_are_left_out():
    from gptlab.layers.router import check_k

    assert "# fmt: skip" in inspect.getsource(check_k)
    listing = show_source(check_k, checks=True)
    assert "fmt:" not in listing.code
    assert listing.code.splitlines()[-1].endswith('f"got {k!r}")')
