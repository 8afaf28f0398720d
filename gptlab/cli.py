"""Command line: ``python -m gptlab train [--option value ...]``, ``python -m gptlab sample``,
``python -m gptlab data FILE... --out FILE`` (the data pipeline, gptlab.data_pipeline), and for a
course (gptlab.course.editions, docs/COURSE.md) ``python -m gptlab edition {student,instructor}
DIR`` and ``python -m gptlab grade SUBMISSIONS_DIR``.

The ``train`` options are generated from the fields of ``TrainConfig``: one ``--field-name`` per
field (``--field_name`` works too, unlisted), typed from its annotation, with the field's own
description, its choices and its default as help. A new field is a new option; ``TRAIN_GROUPS``
says under which heading ``--help`` lists it.

Bad options are refused before any work starts: one line, exit code 2. torch is imported only by
the commands that compute (``--help`` and the other commands' option errors take no time), and
``train``'s options, generated from TrainConfig, load gptlab.training.train only for ``train``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import typing
from dataclasses import Field, fields
from pathlib import Path

from .course.autograde import grade
from .course.editions import CELL_TIMEOUT, CourseError, instructor_edition, student_edition
from .course.sandbox import Limits

TRAIN_GROUPS = {
    "model": ("n_layer", "n_head", "n_embd", "block_size", "gelu", "bias", "dropout", "position",
              "norm", "mlp", "mlp_hidden", "n_kv_head", "rope_base", "tie_embeddings",
              "n_expert", "expert_top_k", "capacity_factor", "aux_loss_weight"),
    "data": ("data", "tokenizer", "vocab_size", "tokenizer_path", "val_fraction", "batch_size"),
    "optimisation": ("optimizer", "lr", "weight_decay", "betas", "eps", "momentum",
                     "decay_position_embeddings", "grad_clip"),
    "schedule": ("max_iters", "lr_schedule", "warmup_iters", "min_lr", "lr_decay_iters"),
    "evaluation and checkpoints": ("eval_interval", "eval_iters", "log_format", "out_dir",
                                   "checkpoint_interval", "resume"),
    "runtime": ("backend", "device", "dtype", "threads", "seed"),
    "speed and memory (gptlab.fast)": ("fused", "recompute", "attention", "classifier",
                                       "precision", "kernels", "cuda_graph", "loss_scale_interval"),
    "parallel": ("parallel", "nproc", "accum_steps"),
}
ALIASES = {"lr": ("--learning-rate",)}  # the names other trainers (Hugging Face's) use


def _optional(parse):
    """A parser that also accepts 'none' (for ``X | None`` fields)."""
    def parse_optional(text: str):
        return None if text.lower() == "none" else parse(text)

    parse_optional.__name__ = parse.__name__  # argparse names the type in its errors
    return parse_optional


def _help(text: str, flag: str, default) -> str:
    """``text`` and the default as one types it; '%' escaped (argparse %-formats help)."""
    if isinstance(default, bool):
        shown = flag if default else "--no-" + flag[2:]
    elif default is None:
        shown = "none"
    elif isinstance(default, tuple):
        shown = " ".join(map(str, default))
    else:
        shown = str(default) if str(default).isprintable() else repr(default)
    return f"{text} (default: {shown})".replace("%", "%%")


def _add_field(group, field: Field, annotation) -> None:
    """The option of one TrainConfig field of type bool, int, float, str (| None) or
    tuple[float, ...]; with choices if the field has them."""
    flag = "--" + field.name.replace("_", "-")
    options = dict(dest=field.name, default=field.default,
                   help=_help(field.metadata["help"], flag, field.default))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) is tuple:
        options.update(type=args[0], nargs=len(args))
    elif type(None) in typing.get_args(annotation):  # X | None
        options["type"] = _optional(args[0])
    elif field.metadata["choices"] is not None:
        aliases = field.metadata["aliases"]
        options.update(type=lambda text: aliases.get(text, text), choices=field.metadata["choices"])
    else:
        options["type"] = annotation
    group.add_argument(flag, *ALIASES.get(field.name, ()), **options)
    if "_" in field.name:  # the field's own name works too, without a line in --help
        group.add_argument("--" + field.name, **{**options, "default": argparse.SUPPRESS,
                                                 "help": argparse.SUPPRESS})


def _add_train_command(commands, options: bool = True) -> None:
    """The ``train`` command; ``options=False`` leaves out its options (and gptlab.training.train,
    which imports torch) where another command is parsed."""
    if not options:
        commands.add_parser("train", help="train (or --resume) a model")
        return
    from .training.config import TrainConfig

    parser = commands.add_parser(
        "train", help="train (or --resume) a model", description=TrainConfig.__doc__,
        epilog="Each option sets the TrainConfig field of its name (--max-iters: max_iters); "
               "'none' sets an optional one to None.")
    groups = {title: parser.add_argument_group(title) for title in TRAIN_GROUPS}
    group_of = {name: title for title, names in TRAIN_GROUPS.items() for name in names}
    hints = typing.get_type_hints(TrainConfig)
    for field in fields(TrainConfig):
        _add_field(groups[group_of[field.name]], field, hints[field.name])
    groups["runtime"].add_argument("--quiet", action="store_true",
                                   help="no progress bar, only the final line")
    groups["evaluation and checkpoints"].add_argument(
        "--overwrite", action="store_true",
        help="start a new run in an out_dir that holds one (its checkpoint stays until the new "
             "run's first checkpoint is complete); without it such a directory is refused")
    warmup = next(f.default for f in fields(TrainConfig) if f.name == "warmup_iters")
    parser.set_defaults(warmup_iters=NotGiven(warmup))  # see config_from_args


SEED_LIMIT = 2**64  # torch's generators take seeds below this (NumPy's any seed >= 0)


def _add_sample_command(commands) -> None:
    parser = commands.add_parser("sample", help="generate text from a checkpoint",
                                 description="Continue a prompt with a trained model.")

    def option(flag, default, text, **options):
        parser.add_argument(flag, default=default, help=_help(text, flag, default), **options)

    parser.add_argument("--checkpoint", required=True,
                        help="the out_dir of a training run, where its checkpoint is")
    option("--prompt", "\n", "text to continue")
    option("--max-new-tokens", 200, "number of tokens to generate", type=int)
    option("--temperature", 1.0, "divides the logits: below 1 sharpens the distribution, "
           "above 1 flattens it", type=float)
    option("--top-k", None, "sample from the k most likely tokens only; none: from all",
           type=_optional(int))
    option("--top-p", None, "sample from the fewest most likely tokens whose probabilities add "
           "up to p (nucleus sampling); none: from all", type=_optional(float))
    option("--seed", 0, f"seed of the sampling, 0 to {SEED_LIMIT - 1}", type=int)
    option("--backend", "torch", "where the arithmetic runs", choices=("numpy", "torch"))
    option("--device", None, "torch device: cpu, cuda, cuda:1, mps...; none: cpu")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="decode with the static decoder, its step replayed as one CUDA graph "
                             "per token (chapter 23): needs --device cuda, a model with learned or "
                             "sinusoidal positions, and a text within the context")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _add_data_command(commands) -> None:
    parser = commands.add_parser(
        "data", help="filter and deduplicate text files into one training file",
        description="GPT-3's data pipeline in miniature (gptlab.data_pipeline.run_pipeline): read "
                    "the documents of FILEs (split at SEPARATOR), drop exact duplicates (after "
                    "normalising case and whitespace) and near-duplicates (MinHash signatures, "
                    "LSH), and write the kept documents, in order, to --out. Bad input (a file "
                    "that cannot be read, text that is not UTF-8, empty documents) is skipped "
                    "and counted in the report.")

    def option(flag, default, text, **options):
        parser.add_argument(flag, default=default, help=_help(text, flag, default), **options)

    parser.add_argument("files", nargs="+", metavar="FILE", help="text files to read, in order")
    parser.add_argument("--out", required=True,
                        help="the file to write the kept documents to: a new one (an existing "
                             "file is refused)")
    option("--separator", "\n\n\n", "the text between two documents, in the inputs and the "
           "output (in bash, type newlines as $'\\n')")
    option("--dedup", True, "near-deduplication after the exact one (--no-dedup: exact only)",
           action=argparse.BooleanOptionalAction)
    option("--shingle-n", 3, "a shingle is this many consecutive units", type=_positive_int)
    option("--shingle-unit", "word", "what a shingle counts", choices=("word", "char"))
    option("--num-perm", 128, "values per MinHash signature", type=_positive_int)
    option("--bands", 32, "LSH bands; bands x rows must not exceed --num-perm", type=_positive_int)
    option("--rows", 4, "signature values per LSH band", type=_positive_int)
    option("--threshold", 0.5, "estimated Jaccard similarity from which a document is a "
           "near-duplicate of an earlier one", type=_fraction)
    option("--seed", 0, "seed of the MinHash permutations", type=int)
    parser.add_argument("--quiet", action="store_true", help="no progress bar, only the report")


def _add_course_commands(commands) -> None:
    def source_options(parser):
        parser.add_argument("--source", default="book",
                            help="the folder of the chapters, the instructor source "
                                 "(default: book)")
        parser.add_argument("--chapters", nargs="+", default=(), metavar="CHAPTER",
                            help="only these chapters: numbers (08) or file names without .ipynb "
                                 "(default: all)")

    edition = commands.add_parser(
        "edition", help="write the student or the instructor edition of the chapters",
        description="student: nbgrader's student version of every chapter with graded work "
                    "(solutions and hidden tests removed, outputs cleared, grading cells locked), "
                    "the data the chapters read and a README; instructor: the chapters as they "
                    "are and RUBRIC.md (points, checkers, hidden tests, model answers).")
    edition.add_argument("kind", choices=("student", "instructor"))
    edition.add_argument("out_dir", help="the folder to write the edition into")
    source_options(edition)

    grade = commands.add_parser(
        "grade", help="autograde submitted chapters, each in a sandbox",
        description="Grade SUBMISSIONS_DIR/<student>/<chapter>.ipynb: each notebook runs in its "
                    "own sandbox, the grading cells (hidden tests put back from the source) run "
                    "in the grader and call the student's functions there; write the points of "
                    "every graded exercise to a CSV file (a total per student at the end).")
    grade.add_argument("submissions", metavar="SUBMISSIONS_DIR",
                       help="one folder per student, holding <chapter>.ipynb files")
    source_options(grade)
    grade.add_argument("--out", default="grades.csv",
                       help="the CSV file to write (default: grades.csv)")
    grade.add_argument("--timeout", type=int, default=CELL_TIMEOUT,
                       help=f"seconds a cell may run before it is interrupted "
                            f"(default: {CELL_TIMEOUT})")
    grade.add_argument("--notebook-timeout", type=float, default=Limits.wall_seconds,
                       metavar="SECONDS",
                       help="seconds a whole submission may take, its notebook and the calls of "
                            "its functions, before all its processes are ended (default: "
                            f"{Limits.wall_seconds:g})")
    grade.add_argument("--memory", type=int, default=Limits.memory_mib, metavar="MIB",
                       help=f"memory a submission may allocate (default: {Limits.memory_mib})")
    grade.add_argument("--unsafe-no-sandbox", action="store_true",
                       help="grade without the sandbox where it cannot start: the students' code "
                            "then runs as you, and can read and change what you can")
    grade.add_argument("--autograded", default=None, metavar="DIR",
                       help="also keep the executed submissions, with what every grading cell "
                            "printed and without hidden tests, in DIR/<student>/<chapter>.ipynb "
                            "(default: none)")
    grade.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                       help="submissions graded at once (default: the number of CPUs)")
    grade.add_argument("--logs", default=None, metavar="DIR",
                       help="write DIR/<student>.log: points, time, notes and flags of each "
                            "chapter (default: the --out file's name with .logs)")


def build_parser(train_options: bool = True) -> argparse.ArgumentParser:
    """The parser of every command; ``train_options=False``: ``train`` without its options (no
    torch imported), for parsing the other commands."""
    parser = argparse.ArgumentParser(
        prog="python -m gptlab",
        description="Train a GPT and sample from it; prepare training text; make the course "
                    "editions and grade them.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train_command(commands, train_options)
    _add_sample_command(commands)
    _add_data_command(commands)
    _add_course_commands(commands)
    return parser


class NotGiven(int):
    """An option's default (equal to it) that tells config_from_args the option was not given."""


def config_from_args(args: argparse.Namespace):
    """The TrainConfig that parsed ``train`` arguments describe. Without --warmup-iters, a
    resumed run keeps its own warmup, and a new one the default warmup (20), shortened to fit a
    cosine that ends sooner."""
    from .training.config import TrainConfig

    values = {field.name: getattr(args, field.name) for field in fields(TrainConfig)}
    warmup = values["warmup_iters"]
    if isinstance(warmup, NotGiven) and values["resume"]:
        warmup = _saved_warmup(values["out_dir"], warmup)
    elif isinstance(warmup, NotGiven) and values["lr_schedule"] == "cosine":
        warmup = max(min(warmup, (values["lr_decay_iters"] or values["max_iters"]) - 1), 0)
    return TrainConfig(**{**values, "warmup_iters": int(warmup)})


def _saved_warmup(out_dir: str, default: int) -> int:
    """The warmup_iters of the run checkpointed in ``out_dir``; ``default`` when none can be read
    (resuming it then says why)."""
    from .training.checkpoint import read_state

    try:
        return int(read_state(out_dir)["train_config"]["warmup_iters"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def run_train(args: argparse.Namespace) -> int:
    from .training.parallel.launch import LaunchFailed, RunInterrupted
    from .training.train import TrainingDiverged, train

    try:
        result = train(config_from_args(args), progress=not args.quiet, overwrite=args.overwrite)
    except (TrainingDiverged, LaunchFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except RunInterrupted as err:  # Ctrl-C, SIGTERM: the step finished and saved
        print(err, file=sys.stderr)
        return err.exit_code
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    last = result.history[-1]
    print(f"step {last['step']}: train loss {last['train_loss']:.4f}, "
          f"val loss {last['val_loss']:.4f}; checkpoint {result.checkpoint_path}, "
          f"log {result.log_path}")
    return 0


class TextStream:
    """Prints the decoded text of tokens as they come (flushed) to ``out`` (None: stdout),
    holding back the bytes of a character that byte-level tokens split until its last byte
    arrives (at most 4 tokens: a UTF-8 character has at most 4 bytes)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out, self.pending = tokenizer, out or sys.stdout, []

    def __call__(self, token: int) -> None:
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if not text.endswith("\ufffd") or len(self.pending) >= 4:  # U+FFFD: incomplete
            self.write(text)

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.pending = []

    def close(self) -> None:
        self.write(self.tokenizer.decode(self.pending) + "\n")


def run_sample(args: argparse.Namespace) -> int:
    from .config import check_device
    from .training.parallel.checkpoint import load_run
    from .training.decode import StaticDecoder
    from .training.sample import check_sampling, generate

    check_sampling(args.temperature, args.top_k, args.top_p)
    if not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, {SEED_LIMIT - 1}], got {args.seed}")
    if not args.prompt:
        raise ValueError("--prompt is empty: the model needs at least one character to continue "
                         "(the default is a newline)")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.backend == "numpy" and args.device not in (None, "cpu"):
        raise ValueError(f"--device {args.device}: the numpy backend runs on the CPU only")
    check_device(args.device)
    if args.cuda_graph and not (args.backend == "torch" and (args.device or "").startswith("cuda")):
        raise ValueError("--cuda-graph replays the decode step on a GPU: it needs --backend torch "
                         "and --device cuda")
    ckpt = load_run(args.checkpoint, backend=args.backend, device=args.device)
    prompt_ids = ckpt.tokenizer.encode(args.prompt)
    decode = functools.partial(generate, ckpt.params, ckpt.model_config)
    if args.cuda_graph:  # refused here, before any output, if the model or the text does not fit
        decoder = StaticDecoder(ckpt.params, ckpt.model_config, cuda_graph=True)
        decoder.check_fits(len(prompt_ids), args.max_new_tokens)
        decode = decoder.generate
    stream = TextStream(ckpt.tokenizer)
    stream.write(args.prompt)
    try:
        decode(prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
               top_p=args.top_p, seed=args.seed, on_token=stream)
    except KeyboardInterrupt:  # Ctrl-C ends a long generation: no traceback
        return 130
    finally:  # what was generated is out, and the line ends
        stream.close()
    return 0


def run_data(args: argparse.Namespace) -> int:
    from .data_pipeline import DedupSettings, NearDuplicateIndex, run_pipeline

    missing = [path for path in args.files if not os.path.isfile(path)]
    if missing:
        raise ValueError(f"no such input file: {', '.join(missing)}")
    if os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(args.out) or "."):
        raise ValueError(f"--out {args.out}: expected a file in an existing folder")
    if os.path.exists(args.out) and any(os.path.samefile(path, args.out) for path in args.files):
        raise ValueError(f"--out {args.out} is one of the input files: it would be overwritten")
    if os.path.exists(args.out):
        raise ValueError(f"--out {args.out} exists: choose a new file name, or remove it first")
    if not args.separator:
        raise ValueError("--separator must not be empty")
    dedup = None
    if args.dedup:
        dedup = DedupSettings(args.shingle_n, args.shingle_unit, args.num_perm, args.bands,
                              args.rows, args.threshold)
        NearDuplicateIndex(dedup.num_perm, dedup.bands, dedup.rows, dedup.threshold)  # checks
    report = run_pipeline(args.files, args.out, separator=args.separator, progress=not args.quiet,
                          dedup=dedup, seed=args.seed)
    for line in report.unreadable:
        print(f"not read: {line}", file=sys.stderr)
    if report.kept == 0:
        os.remove(args.out)  # written by this run, empty
        raise ValueError(f"nothing kept: {report.documents_read} documents read from "
                         f"{report.files_read} files, {report.skipped} skipped as bad input, "
                         f"{report.exact_duplicates + report.near_duplicates} duplicates; "
                         f"{args.out} not written")
    print(f"{report.documents_read} documents read from {report.files_read} files "
          f"({report.skipped} skipped as bad input); {report.exact_duplicates} exact and "
          f"{report.near_duplicates} near-duplicates dropped; {report.kept} kept in {args.out}")
    return 0


def run_edition(args: argparse.Namespace) -> int:
    build = student_edition if args.kind == "student" else instructor_edition
    edition = build(args.out_dir, args.source, args.chapters)
    for reason in edition.left_out:
        print(f"left out {reason}", file=sys.stderr)
    print(f"{args.kind} edition: {len(edition.notebooks)} chapters in {args.out_dir}")
    return 0


def run_grade(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout < 1 or args.notebook_timeout <= 0 or args.memory < 64:
        raise ValueError("--timeout and --notebook-timeout must be positive, --memory at "
                         "least 64 (MiB)")
    limits = Limits(memory_mib=args.memory, cpu_seconds=int(args.notebook_timeout) + 1,
                    wall_seconds=args.notebook_timeout)
    grades = grade(args.submissions, args.source, args.chapters, timeout=args.timeout,
                   autograded=args.autograded, jobs=args.jobs, progress=True, limits=limits,
                   unsafe=args.unsafe_no_sandbox)
    grades.write_csv(args.out)
    logs = args.logs or str(Path(args.out).with_suffix(".logs"))
    grades.write_logs(logs)
    for student, (points, max_points) in grades.totals().items():
        print(f"{student}: {points:g} of {max_points:g} points")
    for line in grades.notes:
        print(f"note: {line}", file=sys.stderr)
    for (student, chapter), flags in sorted(grades.flags.items()):
        for flag in flags:
            print(f"flag: {student}/{chapter}: {flag} (look at it)", file=sys.stderr)
    for line in grades.failed:
        print(f"not graded: {line}", file=sys.stderr)
    print(f"grades of {len(grades.totals())} students in {args.out}, logs in {logs}/")
    return 1 if grades.failed else 0


COMMANDS = {"train": run_train, "sample": run_sample, "data": run_data, "edition": run_edition,
            "grade": run_grade}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(train_options=command == "train").parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (OSError, ValueError, CourseError) as err:  # bad paths, data, configs, checkpoints,
        print(f"error: {err}", file=sys.stderr)       # submissions: no traceback
        return 2
    except KeyboardInterrupt:  # Ctrl-C before any work could be saved
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["build_parser", "config_from_args", "main", "TRAIN_GROUPS"]
