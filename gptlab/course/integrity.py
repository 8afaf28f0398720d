"""What a person should look at in a submission, and what the grader refuses to read
(docs/COURSE.md, "What is flagged").

``grade`` flags, and still grades, what it cannot decide: suspect code in the cells a student
wrote, cells put back, the model answer handed in, hand-ins identical or near-identical across
students. It reads every submission itself, first: a folder name that is not a plain name, or a
directory, FIFO or symlink where a notebook should be, is that submission's "not graded".
"""

from __future__ import annotations

import ast
import copy
import io
import keyword
import os
import re
import stat
import tokenize
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from .editions import HIDDEN, SOLUTION, UNGRADED_STUB, nbgrader_of

MAX_NOTEBOOK = 50 * 2**20  # bytes: a larger hand-in is not read

__all__ = ["Submission", "code_of", "flags", "own_cells", "put_back", "read_notebook",
           "same_code_flags", "same_file_flags", "submissions", "top_level_names", "used_names"]


@dataclass(frozen=True)
class Submission:
    """One hand-in: ``problem`` says why it cannot be graded (None if it can)."""

    student: str
    chapter: Path
    path: Path
    problem: str | None = None


def _name_problem(name: str) -> str | None:
    """Why a student's folder name is refused: a path (``/``, ``..``), NUL, or a control
    character such as a newline. Any other Unicode name is a student."""
    if name in (".", "..") or "/" in name or any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")
                                                 for c in name):
        return f"the folder name {ascii(name)} is not a plain name (no /, .., or control " \
               "characters such as a newline)"
    return None


def _kind_problem(path: Path) -> str | None:
    """Why ``path`` is not read as a notebook: it is a symlink, a directory, or not a file."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return f"{path.name} is a symlink (to {os.readlink(path)}), not a notebook"
    if stat.S_ISDIR(mode):
        return f"{path.name} is a directory, not a notebook"
    if not stat.S_ISREG(mode):
        return f"{path.name} is not a regular file (a FIFO or a device), not a notebook"
    return None


def submissions(folder: Path, known: list[Path],
                selected: list[Path]) -> tuple[list[Submission], list[str]]:
    """Every ``folder/<student>/<chapter>.ipynb`` whose chapter is ``selected``, each with the
    reason it cannot be graded, if any (a student folder that is refused: one per selected
    chapter); and what is left out, said why (a notebook named after none of the ``known``
    chapters)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"submissions folder {folder} does not exist")
    known_stems = [chapter.stem for chapter in known]
    chosen = {chapter.stem: chapter for chapter in selected}
    found, left_out = [], []
    for student_dir in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):
        if os.path.isfile(student_dir) and not student_dir.is_symlink():
            if student_dir.suffix == ".ipynb":
                raise ValueError(f"{student_dir}: put each student's notebooks in "
                                 f"{folder}/<student>/<chapter>.ipynb")
            continue
        problem = _name_problem(student_dir.name) or (
            f"the student's folder is a symlink (to {os.readlink(student_dir)})"
            if student_dir.is_symlink() else None)
        student = student_dir.name if problem is None else ascii(student_dir.name)[1:-1]
        if problem is not None or not student_dir.is_dir():
            found += [Submission(student, chapter, student_dir, problem or "not a folder")
                      for chapter in selected]
            continue
        for notebook in sorted(student_dir.glob("*.ipynb")):
            if notebook.stem in chosen:
                found.append(Submission(student, chosen[notebook.stem], notebook,
                                        _kind_problem(notebook)))
            elif notebook.stem not in known_stems:
                left_out.append(f"{notebook} is not a chapter: a submission is named after its "
                                f"chapter ({', '.join(known_stems)})")
    return found, left_out


def read_notebook(path: Path):
    """A hand-in read as a notebook without following links or blocking on a FIFO; ValueError
    saying why it is not one."""
    import nbformat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        raise ValueError(f"{path.name} cannot be opened: {error.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if info.st_size > MAX_NOTEBOOK:
            raise ValueError(f"{path.name} has {info.st_size} bytes, more than {MAX_NOTEBOOK}")
        data = f.read(MAX_NOTEBOOK + 1)
    try:
        return nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as error:  # nbformat raises JSON, validation and version errors
        raise ValueError(f"{path.name} is not a readable notebook: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") \
            from None


def own_cells(nb, source_nb, release_nb) -> list:
    """The code cells the student wrote or changed (not a cell of the chapter as released)."""
    released = {cell.source for cell in release_nb.cells + source_nb.cells}
    released |= {source.replace(*UNGRADED_STUB) for source in released}  # the student edition's
    return [cell for cell in nb.cells if cell.cell_type == "code" and cell.source.strip()
            and not nbgrader_of(cell).get("locked") and cell.source not in released]


def _shape(source: str) -> str:
    """A cell's code up to names, comments and layout: its tokens, every name as ``N``."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    kept = ("N" if t.type == tokenize.NAME and not keyword.iskeyword(t.string) else t.string
            for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                              tokenize.INDENT, tokenize.DEDENT))
    return " ".join(kept)


def same_code_flags(own_code: dict[str, list[str]]) -> dict[str, str]:
    """student -> a flag, for hand-ins of one chapter whose own code (``own_code``: student ->
    the sources of the cells they wrote) is the same as another student's: identical, or
    the same up to names, comments and layout."""
    flagged = {}
    for how, key in (("identical to", lambda s: "\n".join(c.strip() for c in s)),
                     ("the same code, up to names, comments and layout, as",
                      lambda s: "\n".join(map(_shape, s)))):
        groups: dict[str, list[str]] = {}
        for student, sources in own_code.items():
            if sources:
                groups.setdefault(key(sources), []).append(student)
        for students in groups.values():
            for student in students:
                others = [other for other in students if other != student]
                if others and student not in flagged:
                    flagged[student] = f"{how} the hand-in of {', '.join(others)}"
    return flagged


# What a grader cannot decide, in a cell the student wrote or changed: pattern -> flag.
SUSPECT = {
    r"\b(setprofile|settrace|getprofile|gettrace)\b|sys\.monitoring": "profile/trace hooks",
    r"\bthreading\b|\bThread\(|concurrent\.futures|\w*PoolExecutor|multiprocessing": "threads",
    r"_execution_engine|run_backward|\bautograd\b|\.backward\(|torch\.func\b|functorch"
    r"|requires_grad": "the autograd engine",
    r"\bexec\(|\beval\(|\bcompile\(|getsource|__code__|FunctionType|\bco_\w+=|__import__"
    r"|sys\.modules": "exec/getsource/__code__",
    r"gptlab\.course\.grading|from gptlab\.course import .*\bgrading\b":
        "imports gptlab.course.grading",
}


def code_of(source: str):
    """A cell's syntax tree, IPython magics left out (None if it does not parse)."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _root_name(node) -> str | None:
    """``np`` for ``np.linalg.norm`` (an attribute chain on a name)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _assigned_modules(trees, modules: set[str]) -> list[str]:
    """``np.linalg.norm`` for every assignment to (or deletion of, or setattr on) an attribute
    of a name bound by an import."""
    found = []
    for tree in trees:
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" \
                    and node.args:
                targets = [node.args[0]]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets += target.elts
                elif _root_name(target) in modules and (isinstance(node, ast.Call) or not
                                                        isinstance(target, ast.Name)):
                    found.append(ast.unparse(target))
    return found


def top_level_names(tree) -> set[str]:
    """The names a cell binds at its top level (def, class, assignment, import)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        else:
            names |= {part.id for part in ast.walk(node)
                      if isinstance(part, ast.Name) and isinstance(part.ctx, ast.Store)}
    return names


def used_names(tree) -> set[str]:
    """The global names a cell's code reads: the names it loads, less each function's own
    (its arguments and what it assigns)."""
    found = set()

    def visit(node, local: frozenset):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            body = node.body if isinstance(node.body, list) else [node.body]
            own = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs,
                                   args.vararg, args.kwarg] if a is not None}
            own |= {n.id for part in body for n in ast.walk(part)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for outer in [*args.defaults, *args.kw_defaults,
                          *getattr(node, "decorator_list", [])]:
                if outer is not None:
                    visit(outer, local)
            for part in body:
                visit(part, local | own)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            found.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child, local)

    visit(tree, frozenset())
    return found


def _same_code(a: str, b: str) -> bool:
    """Whether two cells hold the same code, comments and layout aside."""
    tree_a, tree_b = code_of(a), code_of(b)
    if tree_a is None or tree_b is None:
        return a.strip() == b.strip()
    return ast.dump(tree_a) == ast.dump(tree_b)


def flags(nb, source_nb, release_nb) -> list[str]:
    """What a person should look at in a submission (docs/COURSE.md, "What is flagged"): the
    suspect code (SUSPECT) in the cells the student wrote or changed, assignments to attributes of
    imported modules (np., torch.), redefinitions of given functions, answers identical to the
    model answer, and a handed-in chapter of the book itself."""
    own = own_cells(nb, source_nb, release_nb)
    trees = [tree for tree in map(code_of, (cell.source for cell in own)) if tree is not None]
    flags = [flag for pattern, flag in SUSPECT.items()
             if any(re.search(pattern, cell.source) for cell in own)]
    modules = {"np", "numpy", "torch"}
    for cell in nb.cells:
        if cell.cell_type == "code" and (tree := code_of(cell.source)) is not None:
            modules |= {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                        if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    if assigned := _assigned_modules(trees, modules):
        flags.append(f"assigns {', '.join(dict.fromkeys(assigned))}")
    given = set()
    for cell in source_nb.cells:
        if re.fullmatch(r"ex\d+_given(_\d+)?", nbgrader_of(cell).get("grade_id", "")):
            given |= top_level_names(code_of(cell.source) or ast.Module([], []))
    redefined = sorted(given & {name for tree in trees for name in top_level_names(tree)})
    if redefined:
        flags.append(f"redefines the given {', '.join(redefined)}")
    answers = {nbgrader_of(cell)["grade_id"]: cell.source for cell in source_nb.cells
               if nbgrader_of(cell).get("grade_id", "").endswith("_answer")}
    verbatim = [grade_id.removesuffix("_answer") for cell in nb.cells
                if (grade_id := nbgrader_of(cell).get("grade_id", "")) in answers
                and _same_code(cell.source, answers[grade_id])]
    if verbatim:
        flags.append(f"the model answer of {', '.join(verbatim)}, as published")
    if any(HIDDEN[0] in cell.source or SOLUTION[0] in cell.source for cell in nb.cells):
        flags.append("the book's own chapter (it holds the answer or hidden-test markers)")
    return flags


def put_back(nb, release_nb) -> list[str]:
    """Put back, in place, what grading needs: the nbgrader metadata of an exercise cell that
    lost it (found by its first line; Colab and other editors strip it, which is no suspicion),
    and every grading and given cell the submission lacks (after the exercise cell before it).
    Return the flag of the cells put back, if any."""
    held = {nbgrader_of(cell).get("grade_id") for cell in nb.cells} - {None}
    released = [cell for cell in release_nb.cells
                if cell.cell_type == "code" and nbgrader_of(cell).get("grade_id")]
    first_lines = {cell.source.split("\n", 1)[0]: cell for cell in released}
    for cell in nb.cells:
        match = first_lines.get(cell.source.split("\n", 1)[0])
        if cell.cell_type == "code" and not nbgrader_of(cell) and match is not None \
                and nbgrader_of(match)["grade_id"] not in held:
            cell.metadata["nbgrader"] = copy.deepcopy(nbgrader_of(match))
            held.add(nbgrader_of(match)["grade_id"])
    cells = []
    for k, cell in enumerate(released):
        grade_id = nbgrader_of(cell)["grade_id"]
        if grade_id in held or not nbgrader_of(cell).get("locked"):
            continue
        before = {nbgrader_of(c)["grade_id"] for c in released[:k]}
        at = max((i + 1 for i, c in enumerate(nb.cells)
                  if nbgrader_of(c).get("grade_id") in before), default=0)
        nb.cells.insert(at, copy.deepcopy(cell))
        held.add(grade_id)
        cells.append(f"{'grading' if nbgrader_of(cell).get('grade') else 'given'} cell {grade_id}")
    return [f"missing, put back: {'; '.join(cells)}"] if cells else []


def same_file_flags(work: list[Submission]) -> dict[tuple[str, str], str]:
    """(student, chapter) -> a flag, for hand-ins that are the same file as another student's
    (symlinks to one notebook, or to another student's)."""
    groups: dict[str, list[Submission]] = {}
    for submission in work:
        groups.setdefault(os.path.realpath(submission.path), []).append(submission)
    return {(s.student, s.chapter.stem): "the same file as the hand-in of "
            + ", ".join(o.student for o in group if o is not s)
            for group in groups.values() if len(group) > 1 for s in group}
