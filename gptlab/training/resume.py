"""Resuming a run from its last checkpoint: what must match (model, data, tokenizer), what may
change, and the schedule that goes on as the run started it. Book: chapter 11.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path


from ..tokenizers.char import load_tokenizer
from .checkpoint import STATE_FILE, recorded_sha256, require_fields
from .config import TrainConfig


# What a resumed run may change without a word: how far it goes and where it runs (any mode and
# world size resumes any checkpoint); every other changed setting is printed as it resumes.
RESUME_FREE = ("max_iters", "resume", "out_dir", "device", "threads", "parallel", "nproc",
               "accum_steps")


def cosine_end(settings: dict) -> int | None:
    """The update where the cosine of a run's settings (a TrainConfig as a dict) reaches
    min_lr: lr_decay_iters, else max_iters."""
    return settings.get("lr_decay_iters") or settings.get("max_iters")


def resumed_config(cfg: TrainConfig, ckpt, out_dir: Path, data_sha256: str, source: str,
                   report: bool) -> TrainConfig:
    """The config the run in ``out_dir`` (``ckpt``) goes on with, as ``cfg`` asks; ValueError
    unless it can: the same model, data and tokenizer, and the fields train writes into
    state.json.

    A cosine schedule goes on as the run started it: a ``cfg`` that leaves its end to max_iters
    (lr_decay_iters None) ends it where the saved run's ended, so extending a run does not
    restart its schedule (lr_decay_iters moves the end). With ``report``, print (to stderr)
    every other setting that differs from the saved run's, and where the schedule ends."""
    state_path = out_dir / STATE_FILE
    require_fields(ckpt.state, {"history": list, "batch_rng_state": dict, "data_sha256": str,
                                "train_config": dict}, state_path)
    if cfg.tokenizer_path is not None:  # compared as saved: the same JSON for the same tokenizer
        saved_as = load_tokenizer(cfg.tokenizer_path).to_json().encode("utf-8")
        recorded = recorded_sha256(out_dir, ckpt.state, ckpt.state["tokenizer_file"])
        if hashlib.sha256(saved_as).hexdigest() != recorded:
            raise ValueError(f"cannot resume {out_dir}: the tokenizer {cfg.tokenizer_path} is not "
                             f"the one it was trained with, "
                             f"{out_dir / ckpt.state['tokenizer_file']}")
    model_cfg = cfg.model_config(ckpt.tokenizer.vocab_size)
    if ckpt.model_config != model_cfg:
        raise ValueError(f"cannot resume {out_dir}: its model is {ckpt.model_config}, "
                         f"the config asks for {model_cfg}")
    if ckpt.state["data_sha256"] != data_sha256:
        raise ValueError(f"cannot resume {out_dir}: it was trained on other data than {source}")
    saved = ckpt.state["train_config"]
    end = cosine_end(saved)
    same_cosine = saved.get("lr_schedule") == cfg.lr_schedule == "cosine"
    if same_cosine and cfg.lr_decay_iters is None and end not in (None, cfg.max_iters):
        cfg = replace(cfg, lr_decay_iters=end)
        if report and cfg.max_iters > end:
            print(f"resuming {out_dir} to step {cfg.max_iters}: its cosine schedule goes on as it "
                  f"started, at min_lr {cfg.min_lr:g} from step {cfg.lr_decay_iters} "
                  "(--lr-decay-iters sets where it ends)", file=sys.stderr)
    now = json.loads(json.dumps(asdict(cfg)))
    changed = [f"{name} {saved[name]!r} -> {value!r}" for name, value in now.items()
               if name in saved and name not in RESUME_FREE and saved[name] != value
               and not (name == "lr_decay_iters" and cosine_end(saved) == cosine_end(now))]
    if changed and report:
        print(f"resuming {out_dir} at step {ckpt.step} with changed settings: "
              f"{', '.join(changed)}", file=sys.stderr)
    return cfg


__all__ = ["RESUME_FREE", "cosine_end", "resumed_config"]
