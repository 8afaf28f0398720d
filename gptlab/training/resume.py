"""Resuming a run from its last checkpoint: what must match (model, data, tokenizer) and what
may change. Book: chapter 11.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path


from ..tokenizers.char import load_tokenizer
from .checkpoint import STATE_FILE, recorded_sha256, require_fields
from .config import TrainConfig


# What a resumed run may change without a word: how far it goes and where it runs (any mode and
# world size resumes any checkpoint); every other changed setting is printed as it resumes.
RESUME_FREE = ("max_iters", "resume", "out_dir", "device", "threads", "parallel", "nproc",
               "accum_steps")


def check_resume(cfg: TrainConfig, ckpt, out_dir: Path, data_sha256: str, source: str,
                  report: bool) -> None:
    """ValueError unless the run in ``out_dir`` (``ckpt``) can go on as ``cfg`` asks: the same
    model, data and tokenizer, and the fields train writes into state.json. With ``report``,
    print (to stderr) every other setting that differs from the saved run's."""
    state_path = out_dir / STATE_FILE
    require_fields(ckpt.state, {"history": list, "batch_rng_state": dict, "data_sha256": str,
                                "train_config": dict}, state_path)
    if cfg.tokenizer_path is not None:  # compared as saved: the same JSON for the same tokenizer
        saved_as = load_tokenizer(cfg.tokenizer_path).to_json().encode("utf-8")
        recorded = recorded_sha256(out_dir, ckpt.state, ckpt.state["tokenizer_file"])
        if recorded is not None and hashlib.sha256(saved_as).hexdigest() != recorded:
            raise ValueError(f"cannot resume {out_dir}: the tokenizer {cfg.tokenizer_path} is not "
                             f"the one it was trained with, "
                             f"{out_dir / ckpt.state['tokenizer_file']}")
    model_cfg = cfg.model_config(ckpt.tokenizer.vocab_size)
    if ckpt.model_config != model_cfg:
        raise ValueError(f"cannot resume {out_dir}: its model is {ckpt.model_config}, "
                         f"the config asks for {model_cfg}")
    if ckpt.state["data_sha256"] != data_sha256:
        raise ValueError(f"cannot resume {out_dir}: it was trained on other data than {source}")
    saved, now = ckpt.state["train_config"], json.loads(json.dumps(asdict(cfg)))
    changed = [f"{name} {saved[name]!r} -> {value!r}" for name, value in now.items()
               if name in saved and name not in RESUME_FREE and saved[name] != value]
    if changed and report:
        print(f"resuming {out_dir} at step {ckpt.step} with changed settings: "
              f"{', '.join(changed)}", file=sys.stderr)


__all__ = ["RESUME_FREE", "check_resume"]
