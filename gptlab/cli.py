"""Command line: ``python -m gptlab train [--field value ...]`` and ``python -m gptlab sample``.

The ``train`` options are generated from the fields of ``TrainConfig`` (one ``--field-name`` per
field, ``--field_name`` accepted too, typed from its annotation), so a new field is a new option
with no edit here.
"""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import MISSING, fields

from .train import TrainConfig, TrainingDiverged, train


def _optional(parse):
    """A parser that also accepts 'none' (for ``X | None`` fields)."""
    def parse_optional(text: str):
        return None if text.lower() == "none" else parse(text)

    parse_optional.__name__ = parse.__name__  # argparse names the type in its errors
    return parse_optional


def _add_field(parser: argparse.ArgumentParser, name: str, annotation, default) -> None:
    """One ``--field-name`` option for a TrainConfig field of type bool, int, float, str (| None) or
    tuple[float, ...]."""
    flags = ["--" + name.replace("_", "-")] + (["--" + name] if "_" in name else [])
    help_text = f"(default: {default})"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                            default=default, help=help_text)
    elif typing.get_origin(annotation) is tuple:
        parser.add_argument(*flags, dest=name, type=args[0], nargs=len(args), default=default,
                            metavar=name.upper(), help=help_text)
    elif type(None) in typing.get_args(annotation):  # X | None
        parser.add_argument(*flags, dest=name, type=_optional(args[0]), default=default,
                            help=help_text)
    else:
        parser.add_argument(*flags, dest=name, type=annotation, default=default, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gptlab",
                                     description="Train a GPT and sample from it.")
    commands = parser.add_subparsers(dest="command", required=True)

    train_parser = commands.add_parser("train", help="train (or --resume) a model",
                                       description=TrainConfig.__doc__)
    hints = typing.get_type_hints(TrainConfig)
    for field in fields(TrainConfig):
        default = field.default if field.default is not MISSING else field.default_factory()
        _add_field(train_parser, field.name, hints[field.name], default)
    train_parser.add_argument("--quiet", action="store_true", help="no progress bar")

    sample = commands.add_parser("sample", help="generate text from a checkpoint")
    sample.add_argument("--checkpoint", required=True, help="a training out_dir")
    sample.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    sample.add_argument("--max-new-tokens", type=int, default=200)
    sample.add_argument("--temperature", type=float, default=1.0)
    sample.add_argument("--top-k", type=int, default=None)
    sample.add_argument("--top-p", type=float, default=None)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--backend", choices=("numpy", "torch"), default="torch")
    sample.add_argument("--device", default=None)
    return parser


def run_train(args: argparse.Namespace) -> int:
    cfg = TrainConfig(**{field.name: getattr(args, field.name) for field in fields(TrainConfig)})
    try:
        result = train(cfg, progress=not args.quiet)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    last = result.history[-1]
    print(f"step {last['step']}: train loss {last['train_loss']:.4f}, "
          f"val loss {last['val_loss']:.4f}; checkpoint {result.checkpoint_path}, "
          f"log {result.log_path}")
    return 0


def run_sample(args: argparse.Namespace) -> int:
    from .checkpoint import load_run_checkpoint
    from .sample import generate

    ckpt = load_run_checkpoint(args.checkpoint, backend=args.backend, device=args.device)
    prompt_ids = ckpt.tokenizer.encode(args.prompt)
    ids = generate(ckpt.params, ckpt.model_config, prompt_ids, args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed)
    print(ckpt.tokenizer.decode(ids))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_train(args) if args.command == "train" else run_sample(args)
    except (OSError, ValueError) as err:  # bad paths, data, configs, checkpoints: no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
